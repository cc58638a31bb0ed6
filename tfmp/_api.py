"""The public API that `import tfmp` gathers, and what importing it sets up:
`keras.distribution.set_distribution` makes a tfmp strategy current."""

from tfmp import _env

_env.import_tensorflow()

from tfmp import callbacks, integrations, layers  # noqa: E402
from tfmp.auto_layout import auto_layout  # noqa: E402
from tfmp.callbacks import plot_memory  # noqa: E402
from tfmp.devices import list_devices, simulate_devices  # noqa: E402
from tfmp.distributed import initialize  # noqa: E402
from tfmp.inspect.comm_report import comm_report  # noqa: E402
from tfmp.inspect.summary import summary  # noqa: E402
from tfmp.layout import LayoutMap, gather_on_use, split_on_use  # noqa: E402
from tfmp.mesh import DeviceMesh  # noqa: E402
from tfmp.pipeline.balance import balance  # noqa: E402
from tfmp.strategy import ModelParallelStrategy  # noqa: E402
from tfmp.strategy.agreement import ClientsDisagreeError  # noqa: E402
from tfmp.strategy.keras_distribution import follow_distribution_set_before_import  # noqa: E402

# keras.distribution.set_distribution makes a tfmp strategy current.
integrations.install_on_import()
follow_distribution_set_before_import()

__all__ = [
    "ClientsDisagreeError",
    "DeviceMesh",
    "LayoutMap",
    "ModelParallelStrategy",
    "auto_layout",
    "balance",
    "comm_report",
    "gather_on_use",
    "split_on_use",
    "initialize",
    "list_devices",
    "plot_memory",
    "callbacks",
    "layers",
    "simulate_devices",
    "summary",
]
