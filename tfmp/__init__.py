"""tfmp: model parallelism for Keras 3 on TensorFlow, backed by DTensor.

Example:

>>> import tfmp
>>> tfmp.simulate_devices(8)
['/device:CPU:0', ..., '/device:CPU:7']
>>> mesh = tfmp.DeviceMesh((2, 4), ("batch", "model"))
>>> strategy = tfmp.ModelParallelStrategy(mesh, tfmp.LayoutMap(mesh))
"""

import importlib
from typing import Any

from tfmp import _env

_env.configure_dtensor_environment()

__version__ = "0.1.0"

# The command line imports the library when a command needs it: `tfmp --help`
# answers at once, and `--verbose` decides TensorFlow's logging before it loads.
if _env.started_as_command():

    def __getattr__(name: str) -> Any:
        _api = importlib.import_module("tfmp._api")
        if name not in (*_api.__all__, "__all__"):
            raise AttributeError(f"module 'tfmp' has no attribute {name!r}")
        globals().update((public, getattr(_api, public)) for public in (*_api.__all__, "__all__"))
        return globals()[name]

else:
    from tfmp._api import *  # noqa: F403
    from tfmp._api import __all__  # noqa: F401
