"""``python -m pipeline.<command>``: one thin module per command, each calling its implementation's ``main``.

``pipeline/__init__.py`` adds this folder to the package's search path, so ``python -m pipeline.doctor`` finds
``commands/doctor.py`` while the doctor itself lives in ``pipeline.diagnostics.doctor``.
"""
