"""Every invalid config raises a ConfigError naming the field, the value and what is allowed."""
import argparse
import dataclasses
import pickle
import re
import runpy
from pathlib import Path

import pytest

from raypipe import ConfigError, PipelineConfig
from raypipe.cli import main as raypipe_cli
from raypipe.config import load_yaml, max_replicas, parse_replicas, replicas_for_config
from raypipe.core.loss_scale import LossScaler
from raypipe.core.schedule import NATURAL_CHUNKS, SCHEDULES
from raypipe.models.llama import get_config
from raypipe.planning.memory import estimate_pipeline, estimate_stage
from raypipe.run import RunConfig

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("changes,num_layers,field", [
    ({"num_stages": 0}, 4, "num_stages"),
    ({"num_stages": 5}, 4, "num_stages"),
    ({"num_stages": 2.0}, 4, "num_stages"),
    ({"num_micro_batches": 0}, 4, "num_micro_batches"),
    ({"schedule": "zigzag"}, 4, "schedule"),
    ({"activation_checkpoint": "sometimes"}, 4, "activation_checkpoint"),
    ({"precision": "fp8"}, 4, "precision"),
    ({"transport": "carrier-pigeon"}, 4, "transport"),
    ({"clip_grad_norm": 0.0}, 4, "clip_grad_norm"),
    ({"clip_grad_norm": -1}, 4, "clip_grad_norm"),
    ({"clip_grad_value": 0}, 4, "clip_grad_value"),
    ({"num_stages": 2, "balance": [4]}, 4, "balance"),
    ({"num_stages": 2, "balance": [1, 2]}, 4, "balance"),
    ({"num_stages": 2, "balance": [4, 0]}, 4, "balance"),
    ({"num_stages": 2, "balance": "memory"}, 4, "balance"),
    ({"num_stages": 2, "balance": 4}, 4, "balance"),
    ({"activation_checkpoint_segments": 0}, 4, "activation_checkpoint_segments"),
    ({"offload_activations": True}, 4, "offload_activations"),
    ({"metrics_port": 70000}, 4, "metrics_port"),
    ({"placement_timeout_s": 0}, 4, "placement_timeout_s"),
    ({"min_loss_scale": 0}, 4, "min_loss_scale"),
    ({"growth_interval": 0}, 4, "growth_interval"),
    ({"num_replicas": 0}, 4, "num_replicas"),
    ({"num_replicas": (2, 1)}, 4, "num_replicas"),
    ({"num_replicas": (0, 2)}, 4, "num_replicas"),
    ({"num_replicas": (1, 2, 3)}, 4, "num_replicas"),
    ({"num_replicas": (1, 2.0)}, 4, "num_replicas"),
    ({"num_replicas": (1, 2), "transport": "gloo"}, 4, "transport"),
    ({"spare_workers": -1}, 4, "spare_workers"),
    ({"spare_workers": 1.5}, 4, "spare_workers"),
    ({"spare_workers": True}, 4, "spare_workers"),
    ({"boundary_shapes": "static"}, 4, "boundary_shapes"),
])
def test_invalid_config_names_field_value_and_allowed(changes, num_layers, field):
    config = PipelineConfig(**changes)
    with pytest.raises(ConfigError) as error:
        config.validate(num_layers)
    assert error.value.field == field
    message = str(error.value)
    assert field in message and repr(error.value.value) in message
    assert error.value.allowed and error.value.allowed in message


def test_valid_configs_pass():
    PipelineConfig().validate(1)
    elastic = PipelineConfig.from_dict({"num_replicas": [1, 3]})  # as YAML gives it
    elastic.validate(1)
    assert elastic.elastic and (elastic.min_replicas, elastic.max_replicas) == (1, 3)
    assert not PipelineConfig(num_replicas=2).elastic and PipelineConfig(num_replicas=2).max_replicas == 2
    PipelineConfig(num_stages=2, num_micro_batches=8, balance=[3, 1], activation_checkpoint="always",
                   offload_activations=True, clip_grad_norm=1.0, precision="fp16", schedule="1f1b").validate(4)
    for transport in ("p2p", "object_store", "gloo"):  # a spare becomes any executor's worker
        PipelineConfig(spare_workers=2, transport=transport).validate(1)


def test_from_dict_rejects_unknown_keys():
    with pytest.raises(ConfigError, match="num_stagez"):
        PipelineConfig.from_dict({"num_stagez": 2})
    assert PipelineConfig.from_dict({"num_stages": 2}).num_stages == 2


# -- the activation-recompute fields were renamed: "checkpoint" means saved training state ----------

RENAMED = [("checkpoint", "always", "activation_checkpoint"),
           ("checkpoint_segments", 2, "activation_checkpoint_segments"),
           ("offload", True, "offload_activations")]
SAVED_STATE = '("checkpoint" now means saved training state)'


@pytest.mark.parametrize("old,value,new", RENAMED)
def test_old_keywords_name_their_new_name(old, value, new):
    for build in (lambda: PipelineConfig(**{old: value}), lambda: PipelineConfig.from_dict({old: value}),
                  lambda: PipelineConfig().replace(**{old: value})):
        with pytest.raises(ConfigError, match=f"invalid {old}={value!r}: renamed to {new}") as error:
            build()
        assert error.value.field == old and error.value.value == value
    assert getattr(PipelineConfig(**{new: value}), new) == value


def test_old_checkpoint_keyword_says_what_checkpoint_means_now():
    with pytest.raises(ConfigError) as error:
        PipelineConfig(checkpoint="always")
    assert str(error.value) == f"invalid checkpoint='always': renamed to activation_checkpoint {SAVED_STATE}"


def test_balance_accepts_a_list_parameters_or_time_from_yaml_and_the_jobs(tmp_path):
    for balance in ("parameters", "time", None, [1, 3]):
        PipelineConfig(num_stages=2, balance=balance).validate(4)
    path = tmp_path / "run.yaml"
    path.write_text("model: tiny\npipeline:\n  num_stages: 2\n  balance: time\n")
    assert PipelineConfig.from_dict(RunConfig.from_dict(load_yaml(path)).pipeline).balance == "time"
    path.write_text("model: tiny\npipeline:\n  num_stages: 2\n  balance: memory\n")
    with pytest.raises(ConfigError, match="invalid balance='memory'"):
        PipelineConfig.from_dict(RunConfig.from_dict(load_yaml(path)).pipeline).validate()
    for name, extra in (("train_tiny", []), ("train_7b", ["--preset", "tiny", "--stages", "3"])):
        job = load_job(name)
        for flag, expected in (("time", "time"), ("parameters", "parameters"), ("2,2,2", [2, 2, 2])):
            args = job["parse_args"]([*extra, "--balance", flag])
            assert job["run_config"](args).pipeline["balance"] == expected
        with pytest.raises(SystemExit):
            job["parse_args"]([*extra, "--balance", "2,x"])
        assert job["run_config"](job["parse_args"](extra)).pipeline["balance"] == "parameters"


def test_spare_workers_from_yaml_and_the_jobs_flags(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("model: tiny\npipeline:\n  num_stages: 2\n  spare_workers: 1\n")
    assert PipelineConfig.from_dict(RunConfig.from_dict(load_yaml(path)).pipeline).spare_workers == 1
    for name, extra in (("train_tiny", []), ("train_7b", ["--preset", "tiny"])):
        job = load_job(name)
        assert job["run_config"](job["parse_args"](extra)).pipeline["spare_workers"] == 0
        args = job["parse_args"]([*extra, "--spare-workers", "2"])
        assert PipelineConfig.from_dict(job["run_config"](args).pipeline).spare_workers == 2
    with pytest.raises(SystemExit):
        load_job("train_7b")["parse_args"](["--preset", "tiny", "--spare-workers", "-1"])


def test_snapshot_every_from_the_jobs_flags():
    for name, extra in (("train_tiny", []), ("train_7b", ["--preset", "tiny"])):
        job = load_job(name)
        assert job["run_config"](job["parse_args"](extra)).pipeline["snapshot_every"] == PipelineConfig.snapshot_every
        args = job["parse_args"]([*extra, "--snapshot-every", "0"])
        assert PipelineConfig.from_dict(job["run_config"](args).pipeline).snapshot_every == 0
    tiny = load_job("train_tiny")
    pipeline = tiny["run_config"](tiny["parse_args"](["--snapshot-every", "-1"])).pipeline
    with pytest.raises(ConfigError, match=r"^invalid snapshot_every=-1: must be an int >= 0"):
        PipelineConfig.from_dict(pipeline).validate()


def test_boundary_shapes_from_yaml_and_the_jobs_flags(tmp_path):
    assert PipelineConfig().boundary_shapes == "learned"
    assert load_yaml(REPO / "configs" / "tiny.yaml")["pipeline"]["boundary_shapes"] == "learned"
    path = tmp_path / "run.yaml"
    path.write_text("model: tiny\npipeline:\n  num_stages: 2\n  boundary_shapes: headers\n")
    assert PipelineConfig.from_dict(RunConfig.from_dict(load_yaml(path)).pipeline).boundary_shapes == "headers"
    for name, extra in (("train_tiny", []), ("train_7b", ["--preset", "tiny"])):
        job = load_job(name)
        assert job["run_config"](job["parse_args"](extra)).pipeline["boundary_shapes"] == "learned"
        args = job["parse_args"]([*extra, "--boundary-shapes", "headers"])
        assert PipelineConfig.from_dict(job["run_config"](args).pipeline).boundary_shapes == "headers"
        with pytest.raises(SystemExit):
            job["parse_args"]([*extra, "--boundary-shapes", "static"])
    with pytest.raises(ConfigError,
                       match=r"^invalid boundary_shapes='static': must be one of \['learned', 'headers'\]"):
        PipelineConfig(boundary_shapes="static").validate()


def test_schedule_from_yaml_and_the_jobs_flags(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("model: tiny\npipeline:\n  num_stages: 2\n  schedule: zb_h1\n")
    assert PipelineConfig.from_dict(RunConfig.from_dict(load_yaml(path)).pipeline).schedule == "zb_h1"
    for name, extra in (("train_tiny", []), ("train_7b", ["--preset", "tiny"])):
        job = load_job(name)
        assert job["run_config"](job["parse_args"](extra)).pipeline["schedule"] == "gpipe"
        assert job["run_config"](job["parse_args"](extra)).pipeline["virtual_stages"] is None  # the schedule's own
        for schedule in SCHEDULES:
            for chunks in ([], ["--virtual-stages", "2"] if schedule in ("interleaved_1f1b", "zbv") else []):
                args = job["parse_args"]([*extra, "--schedule", schedule, *chunks])
                config = PipelineConfig.from_dict(job["run_config"](args).pipeline)
                config.validate()
                assert (config.schedule, config.virtual_stages) == (schedule, NATURAL_CHUNKS[schedule])
        args = job["parse_args"]([*extra, "--schedule", "interleaved_1f1b", "--virtual-stages", "3"])
        assert PipelineConfig.from_dict(job["run_config"](args).pipeline).virtual_stages == 3
        with pytest.raises(SystemExit):
            job["parse_args"]([*extra, "--schedule", "zb_v"])
        with pytest.raises(ConfigError, match=r"^invalid virtual_stages=1: zbv holds exactly v=2 .*\(leave "
                                              r"virtual_stages unset, None, for the schedule's own: 2\)"):
            args = job["parse_args"]([*extra, "--schedule", "zbv", "--virtual-stages", "1"])
            PipelineConfig.from_dict(job["run_config"](args).pipeline).validate()


def test_virtual_stages_left_unset_are_the_schedules_own_and_follow_a_replaced_schedule():
    assert PipelineConfig.virtual_stages is None
    assert {name: PipelineConfig(schedule=name).virtual_stages for name in SCHEDULES} == {
        "gpipe": 1, "1f1b": 1, "interleaved_1f1b": 2, "zb_h1": 1, "zbv": 2}
    config = PipelineConfig(num_stages=2, num_micro_batches=4)
    zbv = config.replace(schedule="zbv")
    assert zbv.virtual_stages == 2 and zbv.num_virtual_stages == 4 and zbv.loss_stage == 0
    zbv.validate(4)
    assert zbv.replace(schedule="1f1b").virtual_stages == 1  # still unset: back to one chunk
    assert config.replace(num_stages=4).replace(schedule="interleaved_1f1b").virtual_stages == 2
    # given, it is kept as given: a schedule that does not take it is refused, naming the field
    given = PipelineConfig(num_stages=2, num_micro_batches=4, schedule="interleaved_1f1b", virtual_stages=3)
    assert given.replace(num_micro_batches=8).virtual_stages == 3
    with pytest.raises(ConfigError, match=r"^invalid virtual_stages=3: zbv holds exactly v=2") as caught:
        given.replace(schedule="zbv").validate()
    assert caught.value.field == "virtual_stages"
    assert given.replace(schedule="zbv", virtual_stages=None).virtual_stages == 2
    # a schedule set on the object after it was made is resolved when validated; the YAML's null is unset
    later = PipelineConfig(num_stages=2, num_micro_batches=4)
    later.schedule = "zbv"
    later.validate(4)
    assert later.virtual_stages == 2
    assert PipelineConfig.from_dict({"schedule": "zbv", "virtual_stages": None}).virtual_stages == 2
    assert load_yaml(REPO / "configs" / "tiny.yaml")["pipeline"]["virtual_stages"] is None
    assert PipelineConfig(schedule="zbv") == PipelineConfig(schedule="zbv", virtual_stages=2)
    assert pickle.loads(pickle.dumps(config)).replace(schedule="zbv").virtual_stages == 2


def test_interleaved_takes_the_m_torchs_interleaved_schedule_takes():
    accepted = []
    for m in range(1, 17):
        try:
            PipelineConfig(num_stages=4, num_micro_batches=m, schedule="interleaved_1f1b").validate()
            accepted.append(m)
        except ConfigError as error:
            assert error.field == "num_micro_batches"
            assert str(error).startswith(f"invalid num_micro_batches={m}: per replica: interleaved_1f1b needs m "
                                         "micro-batches that split into max(1, m // p) equal rounds")
    assert accepted == [1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 15, 16]


def test_virtual_stages_are_checked_against_the_schedule_transport_micro_batches_and_layers():
    PipelineConfig(num_stages=2, num_micro_batches=4, schedule="interleaved_1f1b", virtual_stages=3).validate(6)
    PipelineConfig(num_stages=2, num_micro_batches=3, schedule="zbv", virtual_stages=2).validate(4)
    PipelineConfig(num_stages=2, num_micro_batches=3, schedule="zbv", virtual_stages=2, use_gpu=True).validate(4)
    cases = [
        (dict(schedule="interleaved_1f1b", virtual_stages=1), "virtual_stages", "needs v >= 2"),
        (dict(schedule="zbv", virtual_stages=3), "virtual_stages", "exactly v=2"),
        (dict(schedule="1f1b", virtual_stages=2), "virtual_stages", "one chunk per worker"),
        (dict(schedule="zbv", virtual_stages=0), "virtual_stages", "int >= 1"),
        (dict(schedule="zbv", virtual_stages=2, transport="gloo"), "transport", "per-step executor only"),
        (dict(schedule="interleaved_1f1b", virtual_stages=2, num_micro_batches=5), "num_micro_batches",
         "split into max"),
        (dict(schedule="interleaved_1f1b", virtual_stages=2, num_replicas=(1, 2)), "num_replicas", "fixed number"),
        (dict(schedule="zbv", virtual_stages=2, balance=[1, 1]), "balance", "one entry per virtual stage"),
    ]
    for changes, field, why in cases:
        config = PipelineConfig(**{"num_stages": 2, "num_micro_batches": 4, **changes})
        with pytest.raises(ConfigError, match=why) as caught:
            config.validate(8)
        assert caught.value.field == field, (changes, caught.value)
    with pytest.raises(ConfigError, match="4 chunks need at least as many layers, the model has 3"):
        PipelineConfig(num_stages=2, schedule="zbv", virtual_stages=2).validate(3)


def test_pack_from_yaml_and_the_jobs_flags(tmp_path):
    from raypipe.run import dataset_path

    path = tmp_path / "run.yaml"
    path.write_text("model: tiny\npack: true\npipeline:\n  num_stages: 1\n")
    assert RunConfig.from_dict(load_yaml(path)).pack is True
    assert RunConfig().pack is False and load_yaml(REPO / "configs" / "tiny.yaml")["pack"] is False
    path.write_text("model: tiny\npack: 'yes'\npipeline:\n  num_stages: 1\n")
    with pytest.raises(ConfigError, match="invalid pack='yes': must be True or False"):
        RunConfig.from_dict(load_yaml(path))
    for name, extra in (("train_tiny", []), ("train_7b", ["--preset", "tiny"])):
        job = load_job(name)
        unpacked, packed = (job["run_config"](job["parse_args"](flags)) for flags in (extra, [*extra, "--pack"]))
        assert (unpacked.pack, packed.pack) == (False, True)
        given = job["run_config"](job["parse_args"]([*extra, "--pack", "--data", str(tmp_path / "d")]))
        assert (given.pack, given.data) == (True, str(tmp_path / "d"))
    # train_7b names its default dataset itself: the packed one lives apart from the unpacked one
    job = load_job("train_7b")
    unpacked, packed = (job["run_config"](job["parse_args"](["--preset", "tiny", *flags]))
                        for flags in ([], ["--pack"]))
    assert unpacked.data == dataset_path(None, 256) and packed.data == dataset_path(None, 256, pack=True)
    assert packed.data != unpacked.data


def test_a_packed_dataset_has_its_own_cache_directory_and_the_run_refuses_the_other_kind():
    from raypipe.data.cache import default_dataset_dir
    from raypipe.run import check_dataset_packed, dataset_path

    # the unpacked default keeps the directory it was prepared in before packing existed
    assert default_dataset_dir(256) == default_dataset_dir(256, pack=False)
    assert default_dataset_dir(256, pack=True) != default_dataset_dir(256)
    assert dataset_path(None, 256, "tok", pack=True) != dataset_path(None, 256, "tok")
    assert dataset_path("s3://b/tokens", 256, pack=True) == "s3://b/tokens"  # a given dataset is used as given
    check_dataset_packed("d", packed=True, pack=True)
    check_dataset_packed("d", packed=False, pack=False)
    with pytest.raises(ValueError, match=r"dataset d is not packed, the run asks for pack=True .*--pack"):
        check_dataset_packed("d", packed=False, pack=True)
    with pytest.raises(ValueError, match="dataset d is packed .* the run asks for pack=False"):
        check_dataset_packed("d", packed=True, pack=False)


def test_old_keys_in_a_yaml_run_config_name_their_new_name(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("model: tiny\npipeline:\n  num_stages: 2\n  checkpoint: always\n")
    with pytest.raises(ConfigError, match="invalid checkpoint='always': renamed to activation_checkpoint"):
        RunConfig.from_dict(load_yaml(path))
    path.write_text("model: tiny\npipeline:\n  num_stages: 2\n  activation_checkpoint: always\n")
    assert RunConfig.from_dict(load_yaml(path)).pipeline["activation_checkpoint"] == "always"
    assert load_yaml(REPO / "configs" / "tiny.yaml")["pipeline"]["activation_checkpoint"] == "never"


def load_job(name: str) -> dict:
    """The globals of ``jobs/<name>.py`` (the jobs are scripts, not a package)."""
    return runpy.run_path(str(REPO / "jobs" / f"{name}.py"), run_name=f"job_{name}")


def test_old_flags_name_their_new_flag(capsys):
    job = load_job("train_7b")
    with pytest.raises(SystemExit) as exit_:  # argparse's usage error: exit 2, no traceback
        job["parse_args"](["--preset", "tiny", "--checkpoint", "always"])
    assert exit_.value.code == 2
    assert capsys.readouterr().err.rstrip().endswith(
        f"error: invalid --checkpoint='always': renamed to --activation-checkpoint {SAVED_STATE}")
    with pytest.raises(SystemExit):
        load_job("train_tiny")["parse_args"](["--offload"])
    assert "invalid --offload=True: renamed to --offload-activations" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        raypipe_cli(["plan", "--model", "tiny", "--checkpoint-segments", "2"])
    assert "renamed to --activation-checkpoint-segments" in capsys.readouterr().err
    # the flags about saved training state keep their names
    args = job["parse_args"](["--preset", "tiny", "--checkpoint-dir", "ckpt", "--checkpoint-every", "5",
                              "--activation-checkpoint", "except_last", "--offload-activations"])
    assert (args.checkpoint_dir, args.checkpoint_every) == ("ckpt", 5)
    pipeline = job["run_config"](args).pipeline
    assert (pipeline["activation_checkpoint"], pipeline["offload_activations"]) == ("except_last", True)


def test_extra_is_gone():
    assert "extra" not in {f.name for f in dataclasses.fields(PipelineConfig)}
    with pytest.raises(TypeError):
        PipelineConfig(extra={})
    with pytest.raises(ConfigError, match="invalid pipeline=\\['extra'\\]: unknown keys"):
        PipelineConfig.from_dict({"extra": {}})


def test_run_config_names_unknown_keys():
    with pytest.raises(ConfigError, match="invalid run config=\\['stepz'\\]: unknown keys"):
        RunConfig.from_dict({"stepz": 3})
    with pytest.raises(ConfigError, match="invalid pipeline=\\['num_stagez'\\]: unknown keys"):
        RunConfig.from_dict({"pipeline": {"num_stagez": 2}})


# -- one set of validators: config, loss scale and the memory model say the same ----------------

def test_positive_int_errors_read_the_same_everywhere():
    config = PipelineConfig(growth_interval=0)
    with pytest.raises(ConfigError, match="^invalid growth_interval=0: must be an int >= 1$"):
        config.validate()
    with pytest.raises(ConfigError, match="^invalid LossScaler.growth_interval=0: must be an int >= 1$"):
        LossScaler(growth_interval=0)
    with pytest.raises(ConfigError, match="^invalid num_micro_batches=0: must be an int >= 1$"):
        estimate_stage(get_config("tiny"), range(2), num_micro_batches=0, micro_batch_size=1, seq_len=8)
    with pytest.raises(ConfigError, match="^invalid num_micro_batches=True: must be an int >= 1$"):
        PipelineConfig(num_micro_batches=True).validate()


def test_choice_errors_read_the_same_everywhere():
    allowed = "must be one of \\['never', 'always', 'except_last'\\]"
    with pytest.raises(ConfigError, match=f"^invalid activation_checkpoint='sometimes': {allowed}$"):
        PipelineConfig(activation_checkpoint="sometimes").validate()
    with pytest.raises(ConfigError, match=f"^invalid activation_checkpoint='sometimes': {allowed}$"):
        estimate_pipeline(get_config("tiny"), 1, 1, 1, 8, activation_checkpoint="sometimes")
    with pytest.raises(ConfigError, match="^invalid precision='fp8': must be one of \\['fp32', 'bf16', 'fp16'\\]$"):
        estimate_pipeline(get_config("tiny"), 1, 1, 1, 8, precision="fp8")


def test_number_errors_read_the_same_everywhere():
    with pytest.raises(ConfigError, match="^invalid initial_loss_scale=0: must be a number > 0$"):
        PipelineConfig(initial_loss_scale=0).validate()
    with pytest.raises(ConfigError, match="^invalid LossScaler.min_scale=0: must be a number > 0$"):
        LossScaler(min_scale=0)
    with pytest.raises(ConfigError, match="^invalid LossScaler.scale=inf: must be a finite number > 0$"):
        LossScaler(scale=float("inf"))
    with pytest.raises(ConfigError, match="offload_activations=True: offloading keeps the inputs"):
        estimate_pipeline(get_config("tiny"), 1, 1, 1, 8, offload_activations=True)


# -- --replicas N | MIN:MAX: one parser for both jobs; an elastic step is sized for MAX -----------

@pytest.mark.parametrize("text,parsed", [("1", 1), ("4", 4), ("1:4", (1, 4)), ("2:2", (2, 2)), (" 1:2 ", (1, 2))])
def test_parse_replicas_reads_a_count_or_a_range(text, parsed):
    assert parse_replicas(text) == parsed
    assert max_replicas(parsed) == (parsed if isinstance(parsed, int) else parsed[1])


@pytest.mark.parametrize("text,message", [
    ("0", "'0': replicas must be >= 1"),
    ("0:2", "'0:2': replicas must be >= 1"),
    ("-1", "'-1': replicas must be >= 1"),
    ("3:2", "'3:2': MIN 3 is above MAX 2"),
    ("a", "'a': replicas must be whole numbers, N or MIN:MAX (e.g. 2 or 1:4)"),
    ("1.5", "'1.5': replicas must be whole numbers"),
    ("1:", "'1:': replicas must be whole numbers"),
    ("1:2:3", "'1:2:3': expected N or MIN:MAX (e.g. 2 or 1:4)"),
])
def test_parse_replicas_rejects_bad_text_naming_it(text, message):
    with pytest.raises(argparse.ArgumentTypeError, match=re.escape(message)):
        parse_replicas(text)


def test_max_replicas_of_a_yaml_range_and_the_config_value():
    assert max_replicas([1, 3]) == 3  # a YAML run config's num_replicas: [1, 3]
    assert replicas_for_config((1, 3)) == [1, 3] and replicas_for_config(2) == 2


@pytest.mark.parametrize("name,flags", [("train_7b", ["--preset", "tiny"]), ("train_tiny", [])])
def test_both_jobs_take_fixed_and_elastic_replicas(name, flags, capsys):
    job = load_job(name)
    assert job["run_config"](job["parse_args"](flags)).pipeline["num_replicas"] == 1  # the default
    assert job["run_config"](job["parse_args"]([*flags, "--replicas", "3"])).pipeline["num_replicas"] == 3
    pipeline = job["run_config"](job["parse_args"]([*flags, "--replicas", "1:4", "--micro-batches", "3"])).pipeline
    assert (pipeline["num_replicas"], pipeline["num_micro_batches"]) == ([1, 4], 3)
    for bad, message in (("3:2", "'3:2': MIN 3 is above MAX 2"), ("0", "'0': replicas must be >= 1")):
        with pytest.raises(SystemExit) as exit_:  # argparse's usage error naming the flag and the text
            job["parse_args"]([*flags, "--replicas", bad])
        assert exit_.value.code == 2
        assert capsys.readouterr().err.rstrip().endswith(f"error: argument --replicas: {message}")


def test_train_7b_prints_an_elastic_range_as_min_dash_max():
    assert load_job("train_7b")["replicas_text"]((1, 2)) == "1-2"
    assert load_job("train_7b")["replicas_text"](2) == "2"


def test_a_schedule_of_model_chunks_runs_on_the_per_step_executor_and_zb_h1_everywhere():
    # the chunked schedules run on the per-step executor (transport p2p) only; zb_h1 (one chunk, split
    # backward) runs on every executor
    for name in ("zbv", "interleaved_1f1b"):
        PipelineConfig(num_stages=2, num_micro_batches=4, schedule=name, virtual_stages=2).validate()
        for transport in ("object_store", "gloo", "nccl"):
            with pytest.raises(ConfigError, match="invalid transport=.*runs on the per-step executor only"):
                PipelineConfig(num_stages=2, num_micro_batches=4, schedule=name, virtual_stages=2,
                               transport=transport).validate()
    for transport in ("p2p", "object_store", "gloo"):
        PipelineConfig(num_stages=2, num_micro_batches=4, schedule="zb_h1", transport=transport).validate()


def test_the_old_name_of_a_step_calls_value_still_works_with_a_deprecation_warning():
    # "direct" names Ray Direct Transport only; the driver's calls over its connections are "connections"
    with pytest.warns(DeprecationWarning, match='step_calls="direct" is renamed step_calls="connections"'):
        config = PipelineConfig(step_calls="direct")
    assert config.step_calls == "connections"
    config.validate()
    with pytest.warns(DeprecationWarning):
        assert PipelineConfig.from_dict({"step_calls": "direct"}).step_calls == "connections"
    assert PipelineConfig().step_calls == "connections"


def test_slow_worker_knobs_from_yaml_and_the_jobs_flags(tmp_path, capsys):
    config = PipelineConfig()
    assert (config.slow_factor, config.slow_steps, config.on_slow) == (1.3, 10, "report")
    shipped = load_yaml(REPO / "configs" / "tiny.yaml")["pipeline"]
    assert (shipped["slow_factor"], shipped["slow_steps"], shipped["on_slow"]) == (1.3, 10, "report")
    path = tmp_path / "run.yaml"
    path.write_text("model: tiny\npipeline:\n  slow_factor: 1.5\n  slow_steps: 20\n  on_slow: report\n")
    loaded = PipelineConfig.from_dict(RunConfig.from_dict(load_yaml(path)).pipeline)
    assert (loaded.slow_factor, loaded.slow_steps, loaded.on_slow) == (1.5, 20, "report")
    for name, extra in (("train_tiny", []), ("train_7b", ["--preset", "tiny"])):
        job = load_job(name)
        pipeline = job["run_config"](job["parse_args"](extra)).pipeline
        assert (pipeline["slow_factor"], pipeline["slow_steps"], pipeline["on_slow"]) == (1.3, 10, "report")
        args = job["parse_args"]([*extra, "--slow-factor", "2", "--slow-steps", "5"])
        assert PipelineConfig.from_dict(job["run_config"](args).pipeline).slow_factor == 2.0
        args = job["parse_args"]([*extra, "--on-slow", "replace", "--spare-workers", "1"])
        assert PipelineConfig.from_dict(job["run_config"](args).pipeline).on_slow == "replace"
        args = job["parse_args"]([*extra, "--on-slow", "rebalance"])
        assert PipelineConfig.from_dict(job["run_config"](args).pipeline).on_slow == "rebalance"
        with pytest.raises(SystemExit):  # a usage error naming the choices
            job["parse_args"]([*extra, "--on-slow", "ignore"])
        assert "'ignore': must be one of ['report', 'replace', 'rebalance']" in capsys.readouterr().err
    for flags in (["--slow-factor", "1"], ["--on-slow", "replace"]):  # replace without a spare to swap in
        with pytest.raises(SystemExit):
            load_job("train_7b")["parse_args"](["--preset", "tiny", *flags])


@pytest.mark.parametrize("changes,allowed", [
    ({"slow_factor": 1.0}, "must be a number > 1"),
    ({"slow_factor": "2"}, "must be a number > 1"),
    ({"slow_steps": 0}, ">= 1"),
    ({"on_slow": "replace"}, "swaps a slow worker for a warm spare: set spare_workers >= 1"),
    ({"on_slow": "rebalance", "schedule": "interleaved_1f1b", "num_micro_batches": 4},
     "not of model chunks (virtual_stages=2)"),
    ({"on_slow": "ignore"}, "must be one of ['report', 'replace', 'rebalance']"),
])
def test_slow_worker_knobs_are_checked_naming_the_field(changes, allowed):
    with pytest.raises(ConfigError) as error:
        PipelineConfig(**changes).validate()
    field = "on_slow" if "on_slow" in changes else next(iter(changes))
    first_line = str(error.value).splitlines()[0]
    assert error.value.field == field and first_line.startswith(f"invalid {field}=") and allowed in first_line
