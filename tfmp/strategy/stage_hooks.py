"""What the strategy asks a pipeline, which it never imports.

A pipeline cuts the mesh into one sub-mesh per stage, and each variable
belongs to one stage and lives on its sub-mesh. `tfmp.pipeline` owns all of
that and is applied on top of the strategy, as torchtitan applies each
parallelism in a module of its own: the strategy only calls the hooks of
`StageHooks` (which mesh holds a new variable, how a variable's optimizer
update runs, whether a host batch can run) and never imports
`tfmp.pipeline`, which builds on it. Without a pipeline the hooks are
`WholeMesh`'s: one mesh holds everything.

The pipeline attaches by registration: importing `tfmp.pipeline` registers
the function that makes a strategy's hooks from its mesh and pipeline
arguments. A registration keeps the dependency pointing the way the layers
do, from the pipeline down to the strategy; a string naming a pipeline module
here (as `tfmp.integrations` names its wrappers) would be an import of a
higher layer that merely hides from `tests/test_architecture.py`. Any
`import tfmp...` runs the `tfmp` package first, which imports `tfmp.pipeline`
(for `LayerGroup` and `balance`), so the pipeline is registered before any
strategy can be made.
"""

from __future__ import annotations

from typing import Any, Callable, Protocol

from tfmp.mesh import DeviceMesh


class StageHooks(Protocol):
    """Where a strategy's variables and batches live, and how its updates run.

    A stage is a number that `MeshVariable.stage` records: which sub-mesh of
    the strategy's mesh holds the variable; None for the home mesh.

    Attributes:
        stage_axis: The mesh axis the stages are cut along, or None. Its
            devices hold different stages, not copies of one computation.
        stage_meshes: What `strategy.stage_meshes` returns, or None.
        home_mesh: Where variables of no stage live, and where outputs,
            losses and metrics are computed; batch targets are placed there.
        input_mesh: Where a batch's inputs are placed.
    """

    stage_axis: str | None
    stage_meshes: Any
    home_mesh: DeviceMesh
    input_mesh: DeviceMesh

    def mesh_of(self, stage: int | None) -> DeviceMesh:
        """The mesh that holds the variables of `stage`."""

    def stage_of_new_variable(self, keras_variable: Any, colocate_with: Any) -> int | None:
        """The stage of a variable being created: `keras_variable` is the
        Keras variable it backs (or None), `colocate_with` the variable an
        optimizer slot is made for (or None)."""

    def update_on_stage(self, variable: Any, update: Callable) -> Callable:
        """`update(variable, *args)` as it must run for `variable`'s optimizer
        update: the arguments and the values it reads on the variable's mesh."""

    def check_host_batch(self, rows: int, trains: bool) -> None:
        """Raises ValueError for a batch of `rows` rows (all clients' rows)
        that cannot run, before it is placed on the mesh. `trains`: whether
        it is fed to a training step (False for evaluate and predict)."""


class WholeMesh:
    """The hooks of a strategy without a pipeline: one mesh holds everything."""

    stage_axis = None
    stage_meshes = None

    def __init__(self, mesh: DeviceMesh):
        self.home_mesh = mesh
        self.input_mesh = mesh

    def mesh_of(self, stage: int | None) -> DeviceMesh:
        del stage
        return self.home_mesh

    def stage_of_new_variable(self, keras_variable: Any, colocate_with: Any) -> None:
        del keras_variable, colocate_with
        return None

    def update_on_stage(self, variable: Any, update: Callable) -> Callable:
        del variable
        return update

    def check_host_batch(self, rows: int, trains: bool) -> None:
        del rows, trains


# (mesh, num_microbatches, schedule) -> the strategy's hooks; checks the arguments.
StagesFactory = Callable[[DeviceMesh, int, str], StageHooks]

_make_stages: StagesFactory | None = None


def register_stages(make_stages: StagesFactory) -> None:
    """Makes `make_stages` give every strategy made from now on its hooks."""
    global _make_stages
    _make_stages = make_stages


def stage_hooks_for(mesh: DeviceMesh, num_microbatches: int, schedule: str) -> StageHooks:
    """The hooks of a strategy over `mesh` with these pipeline arguments,
    from the registered pipeline.

    Raises:
        ValueError: If the arguments do not fit the mesh (the pipeline's
            checks), or no pipeline is registered.
    """
    if _make_stages is None:
        raise ValueError(
            "No pipeline is registered with tfmp.strategy, so a ModelParallelStrategy "
            "cannot read its mesh's 'stage' axis or num_microbatches: import tfmp "
            "(which imports tfmp.pipeline) before making a strategy."
        )
    return _make_stages(mesh, num_microbatches, schedule)
