"""Convert a torch model in a fresh process and say whether that imported timm (it must not: timm is optional)."""
import sys

import torch.nn as nn

import accumnorm

model = accumnorm.convert(nn.Sequential(nn.BatchNorm2d(3)))
print(f"converted {type(model[0]).__name__}; timm imported: {'timm' in sys.modules}")
