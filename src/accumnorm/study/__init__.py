"""`accumnorm study`: rerun the normalization-under-accumulation study on any dataset and norms.

    from accumnorm.study import StudySettings, run_study
    run_study("study-out", StudySettings(dataset="digits", norms=("bn", "bn-exact"), configs=("1x16", "16x1")))
"""
from .runner import run_study
from .settings import StudySettings, parse_config

__all__ = ["run_study", "StudySettings", "parse_config"]
