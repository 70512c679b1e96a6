"""The machine as the doctor sees it (``python -m pipeline.doctor``): the facts it gathers (``facts``) from the
operating system's own sources (``platforms``), the checks of the GPU and its software stack with their fixes
(``doctor``) and of the machine around it (``host_checks``). A run keeps the doctor's findings with its record.
"""
