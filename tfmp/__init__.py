"""tfmp: model parallelism for Keras 3 on TensorFlow, backed by DTensor.

Example:

>>> import tfmp
>>> tfmp.simulate_devices(8)
['/device:CPU:0', ..., '/device:CPU:7']
>>> mesh = tfmp.DeviceMesh((2, 4), ("batch", "model"))
>>> strategy = tfmp.ModelParallelStrategy(mesh, tfmp.LayoutMap(mesh))
"""

from tfmp._env import configure_dtensor_environment

configure_dtensor_environment()

from tfmp import callbacks, layers  # noqa: E402
from tfmp.auto_layout import auto_layout  # noqa: E402
from tfmp.callbacks import plot_memory  # noqa: E402
from tfmp.devices import list_devices, simulate_devices  # noqa: E402
from tfmp.distributed import initialize  # noqa: E402
from tfmp.inspect.comm_report import comm_report  # noqa: E402
from tfmp.inspect.summary import summary  # noqa: E402
from tfmp.layout import LayoutMap, gather_on_use  # noqa: E402
from tfmp.mesh import DeviceMesh  # noqa: E402
from tfmp.pipeline.balance import balance  # noqa: E402
from tfmp.strategy import ModelParallelStrategy  # noqa: E402
from tfmp.strategy.agreement import ClientsDisagreeError  # noqa: E402
from tfmp import integrations  # noqa: E402
from tfmp.strategy.keras_distribution import follow_distribution_set_before_import  # noqa: E402

# keras.distribution.set_distribution makes a tfmp strategy current.
integrations.install_on_import()
follow_distribution_set_before_import()

__version__ = "0.1.0"

__all__ = [
    "ClientsDisagreeError",
    "DeviceMesh",
    "LayoutMap",
    "ModelParallelStrategy",
    "auto_layout",
    "balance",
    "comm_report",
    "gather_on_use",
    "initialize",
    "list_devices",
    "plot_memory",
    "callbacks",
    "layers",
    "simulate_devices",
    "summary",
]
