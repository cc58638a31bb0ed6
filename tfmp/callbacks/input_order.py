"""`InputOrderCheck`: every client of a multi-client run reads the same batches."""

from __future__ import annotations

import keras
from tensorflow.experimental import dtensor

from tfmp.strategy import agreement
from tfmp.strategy.extended import extended_of


class InputOrderCheck(keras.callbacks.Callback):
    """Stops training when the clients of a run read different batches.

    In a multi-client run (`tfmp.initialize`) each client runs its own input
    pipeline. With whole batches (`fit(x, y)`, a `tf.data.Dataset`), every
    client must read the same batches in the same order; clients that read
    their own rows (`strategy.distribute_datasets_from_function`) must read
    the same rows as the clients that hold the same part of each batch. A
    client whose shuffle is seeded otherwise trains without a word on other
    examples than the others, and the losses each reports are not the
    model's. This callback keeps a CRC-32 of every training batch each client
    reads and at every epoch end compares them across clients (through the
    coordination service's key-value store); on a difference, every client
    raises `tfmp.ClientsDisagreeError` naming the client, the epoch and the
    first batch that differs. The cost is one pass over each batch's bytes
    on the host, and one exchange of the fingerprints per epoch. In a
    single-client run it checks nothing.

    Examples:
        >>> check = tfmp.callbacks.InputOrderCheck()
        >>> history = model.fit(x, y, batch_size=16, epochs=2, callbacks=[check], verbose=0)
    """

    def on_train_begin(self, logs: dict | None = None) -> None:
        extended = extended_of(self.model.distribute_strategy)
        if extended is None:
            raise ValueError(
                f"InputOrderCheck checks the batches of a model on a "
                f"tfmp.ModelParallelStrategy; model {self.model.name!r} runs under "
                f"{type(self.model.distribute_strategy).__name__}. Build and compile "
                "it in the strategy's scope."
            )
        if dtensor.num_clients() > 1:
            extended.batch_order = agreement.BatchOrder()

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        batch_order = extended_of(self.model.distribute_strategy).batch_order
        if batch_order is not None:
            batch_order.check(epoch)

    def on_train_end(self, logs: dict | None = None) -> None:
        extended_of(self.model.distribute_strategy).batch_order = None
