"""Synthetic data for gdn_jax experiments: MQAR (Zoology), needle-in-a-haystack, state tracking.

Every task config has ``seed``, ``test_examples``, ``model_vocab_size``, ``chance``,
``max_labels``, ``label``, ``metric`` and ``generate(num_examples, seed, *, split)`` returning a
:class:`TaskBatch`; :class:`TaskLoader`, :func:`make_test_set` and the ``seed_*`` functions work for
all of them (:mod:`gdn_jax.data.loader`). :data:`TASK_CONFIGS` maps each task name (``name``, the
README's ``--task``) to its config class.
"""

from gdn_jax.data.common import IGNORE_INDEX, TaskBatch
from gdn_jax.data.loader import (
    TaskLoader,
    make_test_set,
    make_train_set,
    seed_epoch_shuffle,
    seed_stream_batch,
    seed_test_set,
    seed_train_set,
)
from gdn_jax.data.mqar import MQARConfig, generate_mqar
from gdn_jax.data.niah import NIAHConfig, generate_niah
from gdn_jax.data.state_tracking import StateTrackingConfig, generate_state_tracking, scaled_accuracy

#: Task name -> task config class (``"mqar"``, ``"niah"``, ``"state_tracking"``).
TASK_CONFIGS = {cls.name: cls for cls in (MQARConfig, NIAHConfig, StateTrackingConfig)}

__all__ = [
    "IGNORE_INDEX",
    "MQARConfig",
    "NIAHConfig",
    "StateTrackingConfig",
    "TASK_CONFIGS",
    "TaskBatch",
    "TaskLoader",
    "generate_mqar",
    "generate_niah",
    "generate_state_tracking",
    "make_test_set",
    "make_train_set",
    "scaled_accuracy",
    "seed_epoch_shuffle",
    "seed_stream_batch",
    "seed_test_set",
    "seed_train_set",
]
