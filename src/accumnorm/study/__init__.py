"""`accumnorm study`: rerun the normalization-under-accumulation study on any dataset and norms, or measure
SimCLR under accumulation (`SimCLRSettings`).

    from accumnorm.study import StudySettings, SimCLRSettings, run_study
    run_study("study-out", StudySettings(dataset="digits", norms=("bn", "bn-exact"), configs=("1x16", "16x1")))
    run_study("simclr-out", SimCLRSettings(dataset="digits16", configs=("4x4",), iterations=40, eval_every=20))

The studies' datasets, networks and SimCLR pieces are public too, for the examples and your own experiments.
"""
from ._data import Dataset, load_dataset
from ._model import SimpleModel
from ._runner import run_study
from ._settings import SimCLRSettings, StudySettings, parse_config
from ._simclr import SimCLRNet, linear_probe, nt_xent, project, two_views

__all__ = ["run_study", "StudySettings", "SimCLRSettings", "parse_config", "Dataset", "load_dataset", "SimpleModel",
           "SimCLRNet", "nt_xent", "two_views", "project", "linear_probe"]
