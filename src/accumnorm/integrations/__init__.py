"""accumnorm inside training frameworks. Each integration is its own module, imported only when asked
for, so that its framework stays an optional dependency:

    from accumnorm.integrations.lightning import ExactAccumulation     # pip install 'accumnorm[lightning]'
    from accumnorm.integrations.accelerate import ExactAccumulator     # pip install 'accumnorm[accelerate]'
"""
__all__: list[str] = []
