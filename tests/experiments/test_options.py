"""Options the chosen task does not read are refused (as the mixers' options are): `--task niah
--num_kv_pairs 4` used to train NIAH and record num_kv_pairs in results.json. A sweep preset's
settings serve every task: the ones a task does not read are left out of its runs."""
import os
import runpy

import pytest

from gdn_jax import sweep as S
from gdn_jax.recall import RecallConfig, task_options, validate

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_task_options_map():
    opts = task_options()
    assert opts["num_kv_pairs"] == ("mqar",) and opts["key_len"] == ("niah",)
    assert opts["modulus"] == ("state_tracking",) and set(opts["seq_len"]) == {"mqar", "niah"}
    assert "seed" not in opts and "test_examples" not in opts  # every task reads them


@pytest.mark.parametrize("task, field, value", [("niah", "num_kv_pairs", 4), ("niah", "power_a", 0.5),
                                                ("mqar", "key_len", 2), ("mqar", "modulus", 3),
                                                ("state_tracking", "vocab_size", 32),
                                                ("state_tracking", "seq_len", 128),
                                                ("niah", "train_max_len", 12)])
def test_unread_task_option_refused(task, field, value):
    with pytest.raises(ValueError, match=rf"RecallConfig\.{field} = {value!r} is an option of the .* task; task "
                                         rf"'{task}' does not read it"):
        validate(RecallConfig(task=task, **{field: value}))
    validate(RecallConfig(task=task))  # the defaults pass
    reader = task_options()[field][0]
    validate(RecallConfig(task=reader, **{field: value}))  # the task that reads it takes it


def test_fixed_set_options_refused_with_stream_data():
    for kw in (dict(train_examples=500), dict(device_data=False)):
        with pytest.raises(ValueError, match="data_mode 'fixed'"):
            validate(RecallConfig(**kw))
        validate(RecallConfig(data_mode="fixed", **kw))


def test_script_names_the_flag():
    main = runpy.run_path(os.path.join(REPO, "experiments", "recall.py"))["main"]
    with pytest.raises(SystemExit, match="--num_kv_pairs = 4 is an option of the mqar task; task 'niah'"):
        main(["--task", "niah", "--num_kv_pairs", "4"])


def test_presets_serve_every_task_but_base_settings_are_checked(tmp_path):
    st = S.apply_preset(S.SweepConfig(preset="cpu_smoke", task="state_tracking", out=str(tmp_path)), ["task", "out"])
    keys = {x.split("=")[0] for x in st.base}
    assert "vocab_size" not in keys and "test_max_len" in keys  # the preset's MQAR/NIAH vocabulary left out
    mq = S.apply_preset(S.SweepConfig(preset="cpu_smoke", out=str(tmp_path)), ["out"])
    keys = {x.split("=")[0] for x in mq.base}
    assert "vocab_size" in keys and "test_max_len" not in keys
    assert len(S.validate(mq)) == len(S.cells(mq))
    # a setting the user adds with --base is not filtered: refused by the runs' validation
    bad = S.apply_preset(S.SweepConfig(preset="cpu_smoke", mixers=("gdn",), base=("modulus=3",), out=str(tmp_path)),
                         ["mixers", "base", "out"])
    with pytest.raises(ValueError, match=r"RecallConfig\.modulus = 3 is an option of the state_tracking task"):
        S.validate(bad)
