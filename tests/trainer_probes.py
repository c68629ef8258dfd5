"""The objective of a built Trainer evaluated outside its loop, for the tests only (the Trainer itself only loops):
its loss and metrics on given parameters, and its loss and gradients on one host batch."""

import jax
import jax.numpy as jnp

from train.step import step_loss


def loss_and_metrics(trainer, params, t_state, batch, nan_at=-1):
    """(loss, metrics) of the trainer's step objective at `params` on a device batch (its program, step 0)."""
    return step_loss(trainer.program(), params, t_state, batch, jnp.zeros((), jnp.int32), nan_at, trainer.run.vocab_ids)


def loss_and_grads(trainer, host_batch: dict):
    """(loss, grads) at the trainer's current parameters on a host batch, on its mesh: for sharding checks."""
    prog, vocab = trainer.program(), trainer.run.vocab_ids
    fn = jax.jit(jax.value_and_grad(lambda p, t, b: step_loss(prog, p, t, b, jnp.zeros((), jnp.int32), -1, vocab)[0]))
    with jax.set_mesh(trainer.run.mesh):
        return fn(trainer.state["params"], trainer.run.t_state, trainer.put_batch(host_batch))
