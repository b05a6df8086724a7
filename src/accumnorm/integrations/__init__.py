"""accumnorm inside other libraries. Each integration is its own module, imported only when asked
for, so that its library stays an optional dependency:

    from accumnorm.integrations.timm import BatchNormAct2d             # pip install 'accumnorm[timm]'
    from accumnorm.integrations.lightning import ExactAccumulation     # pip install 'accumnorm[lightning]'
    from accumnorm.integrations.accelerate import ExactAccumulator     # pip install 'accumnorm[accelerate]'
    from accumnorm.integrations.transformers import ExactTrainer       # pip install 'accumnorm[transformers]'
    custom_imports=dict(imports=["accumnorm.integrations.mmengine"])   # pip install 'accumnorm[mmengine]'
"""
__all__: list[str] = []
