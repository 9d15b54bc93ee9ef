"""Synthetic data for gdn_jax experiments."""

from gdn_jax.data.mqar import (
    IGNORE_INDEX,
    MQARBatch,
    MQARConfig,
    MQARLoader,
    generate_mqar,
    make_test_set,
    make_train_set,
    seed_epoch_shuffle,
    seed_stream_batch,
    seed_test_set,
    seed_train_set,
)

__all__ = [
    "IGNORE_INDEX",
    "MQARBatch",
    "MQARConfig",
    "MQARLoader",
    "generate_mqar",
    "make_test_set",
    "make_train_set",
    "seed_epoch_shuffle",
    "seed_stream_batch",
    "seed_test_set",
    "seed_train_set",
]
