"""tfmp: model parallelism for Keras 3 on TensorFlow, backed by DTensor.

Example:

>>> import tfmp
>>> tfmp.simulate_devices(8)
['/device:CPU:0', ..., '/device:CPU:7']
>>> mesh = tfmp.DeviceMesh((2, 4), ("batch", "model"))
>>> strategy = tfmp.ModelParallelStrategy(mesh, tfmp.LayoutMap(mesh))
"""

from typing import Any

from tfmp import _env

_env.configure_dtensor_environment()

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

_imported = False


def _import_library() -> None:
    """Imports TensorFlow, Keras and the public API, and has
    `keras.distribution.set_distribution` make a tfmp strategy current."""
    global _imported
    if _imported:
        return
    _imported = True
    _env.import_tensorflow()

    from tfmp import callbacks, layers, integrations
    from tfmp.auto_layout import auto_layout
    from tfmp.callbacks import plot_memory
    from tfmp.devices import list_devices, simulate_devices
    from tfmp.distributed import initialize
    from tfmp.inspect.comm_report import comm_report
    from tfmp.inspect.summary import summary
    from tfmp.layout import LayoutMap, gather_on_use
    from tfmp.mesh import DeviceMesh
    from tfmp.pipeline.balance import balance
    from tfmp.strategy import ModelParallelStrategy
    from tfmp.strategy.agreement import ClientsDisagreeError
    from tfmp.strategy.keras_distribution import follow_distribution_set_before_import

    globals().update(
        callbacks=callbacks,
        layers=layers,
        integrations=integrations,
        auto_layout=auto_layout,
        plot_memory=plot_memory,
        list_devices=list_devices,
        simulate_devices=simulate_devices,
        initialize=initialize,
        comm_report=comm_report,
        summary=summary,
        LayoutMap=LayoutMap,
        gather_on_use=gather_on_use,
        DeviceMesh=DeviceMesh,
        balance=balance,
        ModelParallelStrategy=ModelParallelStrategy,
        ClientsDisagreeError=ClientsDisagreeError,
    )
    integrations.install_on_import()
    follow_distribution_set_before_import()


def __getattr__(name: str) -> Any:
    # Only the `tfmp` command line gets here before the library is imported.
    if name not in __all__ or _imported:
        raise AttributeError(f"module 'tfmp' has no attribute {name!r}")
    _import_library()
    return globals()[name]


# The command line imports the library when a command needs it: `tfmp --help`
# answers at once, and `--verbose` decides TensorFlow's logging before it loads.
if not _env.started_as_command():
    _import_library()
