"""`accumnorm study`: rerun the normalization-under-accumulation study on any dataset and norms, or measure
SimCLR under accumulation (`SimCLRSettings`).

    from accumnorm.study import StudySettings, SimCLRSettings, run_study
    run_study("study-out", StudySettings(dataset="digits", norms=("bn", "bn-exact"), configs=("1x16", "16x1")))
    run_study("simclr-out", SimCLRSettings(dataset="digits16", configs=("4x4",), iterations=40, eval_every=20))
"""
from .runner import run_study
from .settings import StudySettings, parse_config
from .simclr import SimCLRSettings

__all__ = ["run_study", "StudySettings", "SimCLRSettings", "parse_config"]
