"""accumnorm inside other libraries. Each integration is its own module, imported only when asked
for, so that its library stays an optional dependency:

    from accumnorm.integrations.timm import BatchNormAct2d             # pip install 'accumnorm[timm]'
"""
__all__: list[str] = []
