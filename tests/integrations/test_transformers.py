"""``gefen.integrations.transformers``: the TrainingArguments mapping, ``optim_args`` parsing, real ``Trainer`` and
``Accelerator`` runs on the CPU (tiny random BERT built from a config, nothing downloaded), Trainer resume, and
the lazy import of transformers."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import re  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
from transformers import BertConfig, BertForSequenceClassification, Trainer, TrainingArguments  # noqa: E402

import gefen  # noqa: E402
from gefen.integrations import transformers as integration  # noqa: E402
from gefen.integrations.transformers import (  # noqa: E402
    GefenMuonHybridFactory,
    TrainerGefen,
    optimizer_cls_and_kwargs,
    parse_optim_args,
)

ROOT = Path(__file__).resolve().parents[2]
VOCAB, SEQ = 64, 8
HYBRID = "gefen-muon-hybrid"
OPTIMIZERS = ["gefen", HYBRID]

#: The 2-D hidden weights of the one-layer BERT below, written out by hand from BERT's architecture: the Muon half
#: of the hybrid. Embeddings, LayerNorms, biases and the classifier head belong to the backup.
BERT_HIDDEN_WEIGHTS = {
    "bert.encoder.layer.0.attention.self.query.weight",
    "bert.encoder.layer.0.attention.self.key.weight",
    "bert.encoder.layer.0.attention.self.value.weight",
    "bert.encoder.layer.0.attention.output.dense.weight",
    "bert.encoder.layer.0.intermediate.dense.weight",
    "bert.encoder.layer.0.output.dense.weight",
    "bert.pooler.dense.weight",
}


def tiny_bert(seed: int = 0) -> BertForSequenceClassification:
    """A random one-layer BERT classifier (hidden 32, ~12k parameters), dropout off so runs are reproducible."""
    torch.manual_seed(seed)
    config = BertConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=SEQ,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        num_labels=2,
    )
    return BertForSequenceClassification(config)


def dataset(rows: int = 16, seed: int = 1) -> list[dict[str, torch.Tensor]]:
    """Random token rows labelled by their first token (learnable through the pooled [CLS] position)."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (rows, SEQ), generator=generator)
    labels = (ids[:, 0] < VOCAB // 2).long()
    mask = torch.ones(SEQ, dtype=torch.long)
    return [{"input_ids": ids[i], "attention_mask": mask, "labels": labels[i]} for i in range(rows)]


def training_args(tmp_path: Path, **overrides) -> TrainingArguments:
    """CPU TrainingArguments for the tiny runs: GA 2, linear schedule with warmup, no reports, no progress bars."""
    settings = {
        "output_dir": str(tmp_path / "out"),
        "use_cpu": True,
        "report_to": [],
        "disable_tqdm": True,
        "per_device_train_batch_size": 8,
        "gradient_accumulation_steps": 2,
        "learning_rate": 3e-3,
        "lr_scheduler_type": "linear",
        "warmup_steps": 2,
        "logging_steps": 1,
        "save_strategy": "no",
        "seed": 0,
    }
    settings.update(overrides)
    return TrainingArguments(**settings)


def make_trainer(model, args, optimizer: str, rows: int = 16, **kwargs) -> Trainer:
    pair = optimizer_cls_and_kwargs(args, optimizer, **({"fused": False} | kwargs))
    return Trainer(model=model, args=args, train_dataset=dataset(rows), optimizer_cls_and_kwargs=pair)


def group_of(optimizer: torch.optim.Optimizer, param: torch.Tensor) -> dict:
    return next(g for g in optimizer.param_groups if any(p is param for p in g["params"]))


# ---------------------------------------------------------------------------------------------- the mapping
def test_gefen_mapping_lands_in_param_groups(tmp_path):
    args = training_args(tmp_path, learning_rate=2e-3, adam_beta1=0.8, adam_beta2=0.95, adam_epsilon=1e-6)
    args.weight_decay = 0.05
    model = tiny_bert()
    optimizer = make_trainer(model, args, "gefen").create_optimizer()
    assert isinstance(optimizer, gefen.Gefen) and type(optimizer) is TrainerGefen
    for group in optimizer.param_groups:
        assert group["lr"] == 2e-3 and group["betas"] == (0.8, 0.95) and group["eps"] == 1e-6
        assert group["fused"] is False
    layer = model.bert.encoder.layer[0]
    # Trainer's rule, as for AdamW: matrices decay, biases and LayerNorm weights do not.
    assert group_of(optimizer, layer.attention.self.query.weight)["weight_decay"] == 0.05
    assert group_of(optimizer, model.bert.embeddings.word_embeddings.weight)["weight_decay"] == 0.05
    assert group_of(optimizer, layer.attention.self.query.bias)["weight_decay"] == 0.0
    assert group_of(optimizer, layer.output.LayerNorm.weight)["weight_decay"] == 0.0


def test_gefen_overrides_win_over_training_arguments(tmp_path):
    args = training_args(tmp_path, learning_rate=2e-3)
    overrides = {"lr": 1e-2, "betas": (0.5, 0.6), "eps": 1e-5, "deterministic": True, "factored_v_2d": False}
    optimizer = make_trainer(tiny_bert(), args, "gefen", **overrides).create_optimizer()
    for group in optimizer.param_groups:
        assert (group["lr"], group["betas"], group["eps"], group["factored_v_2d"]) == (1e-2, (0.5, 0.6), 1e-5, False)
    assert optimizer.deterministic is True and optimizer.nonfinite == "raise"


def test_gefen_route_drops_trainers_empty_param_group(tmp_path):
    # BitFit-style run: only biases train, Trainer's decayed group is empty (TrainerGefen drops it, as it always did).
    model = tiny_bert()
    for name, param in model.named_parameters():
        param.requires_grad_(name.endswith(".bias"))
    optimizer = make_trainer(model, training_args(tmp_path), "gefen").create_optimizer()
    biases = [p for n, p in model.named_parameters() if n.endswith(".bias")]
    assert len(optimizer.param_groups) == 1
    assert {id(p) for p in optimizer.param_groups[0]["params"]} == {id(p) for p in biases}
    assert optimizer.param_groups[0]["weight_decay"] == 0.0


def test_hybrid_mapping_routes_the_trainers_model(tmp_path):
    args = training_args(tmp_path, learning_rate=2e-3, adam_beta1=0.8, adam_beta2=0.95, adam_epsilon=1e-6)
    args.weight_decay = 0.05
    model = tiny_bert()
    trainer = make_trainer(model, args, HYBRID)
    hybrid = trainer.create_optimizer()
    assert isinstance(hybrid, gefen.GefenMuonHybrid) and isinstance(hybrid.backup, gefen.Gefen)
    names = {id(p): n for n, p in model.named_parameters()}
    assert {names[id(p)] for g in hybrid.muon.param_groups for p in g["params"]} == BERT_HIDDEN_WEIGHTS
    assert {names[id(p)] for g in hybrid.backup.param_groups for p in g["params"]} == set(names.values()) - (
        BERT_HIDDEN_WEIGHTS
    )
    (muon,) = hybrid.muon.param_groups
    (backup,) = hybrid.backup.param_groups
    assert (muon["lr"], muon["weight_decay"]) == (2e-3, 0.05)
    assert (muon["momentum"], muon["eps"]) == (0.95, 1e-7)  # Muon's own defaults, not adam_beta1/adam_epsilon
    assert (backup["lr"], backup["betas"], backup["eps"], backup["weight_decay"]) == (2e-3, (0.8, 0.95), 1e-6, 0.0)


def test_hybrid_overrides_win_over_training_arguments(tmp_path):
    args = training_args(tmp_path, learning_rate=2e-3)
    args.weight_decay = 0.05
    overrides = {"weight_decay": 0.2, "backup_weight_decay": 0.01, "backup_lr": 5e-4, "backup_optimizer": "adamw"}
    hybrid = make_trainer(tiny_bert(), args, HYBRID, **overrides).create_optimizer()
    assert isinstance(hybrid.backup, torch.optim.AdamW)
    assert (hybrid.muon.param_groups[0]["lr"], hybrid.muon.param_groups[0]["weight_decay"]) == (2e-3, 0.2)
    assert (hybrid.backup.param_groups[0]["lr"], hybrid.backup.param_groups[0]["weight_decay"]) == (5e-4, 0.01)


def test_hybrid_factory_refuses_another_model_than_the_one_given(tmp_path):
    args = training_args(tmp_path)
    given, other = tiny_bert(), tiny_bert()
    cls, kwargs = optimizer_cls_and_kwargs(args, HYBRID, model=given, fused=False)
    assert cls is GefenMuonHybridFactory and kwargs["expected_model"] is given
    trainer = Trainer(model=other, args=args, train_dataset=dataset(), optimizer_cls_and_kwargs=(cls, kwargs))
    with pytest.raises(ValueError, match="another model, BertForSequenceClassification"):
        trainer.create_optimizer()
    hybrid = cls()(given, **kwargs)
    assert {id(p) for g in hybrid.param_groups for p in g["params"]} == {id(p) for p in given.parameters()}


def test_hybrid_with_model_is_checked_on_that_model_at_once(tmp_path):
    model = torch.nn.Sequential(torch.nn.ReLU())  # fine for the 2x2 stand-in, not for this model
    with pytest.raises(gefen.ConfigError, match="no parameter"):
        optimizer_cls_and_kwargs(training_args(tmp_path), HYBRID, model=model)


def test_recommended_lr_is_applied_only_when_asked(tmp_path, monkeypatch):
    args = training_args(tmp_path, learning_rate=2e-3)
    monkeypatch.setitem(integration.RECOMMENDED_LR_FACTORS, "gefen", 0.5)
    monkeypatch.setitem(integration.RECOMMENDED_LR_FACTORS, HYBRID, 0.25)
    assert optimizer_cls_and_kwargs(args)[1]["lr"] == 2e-3
    assert optimizer_cls_and_kwargs(args, recommended_lr=True)[1]["lr"] == 1e-3
    assert optimizer_cls_and_kwargs(args, HYBRID)[1]["lr"] == 2e-3
    assert optimizer_cls_and_kwargs(args, HYBRID, recommended_lr=True)[1]["lr"] == 5e-4
    with pytest.raises(ValueError, match="either lr= or recommended_lr=True"):
        optimizer_cls_and_kwargs(args, recommended_lr=True, lr=1e-3)


def _best_lr(text: str, table_header: str) -> float:
    """The bold (best) lr of a sweep table in docs/lr_sweep.md."""
    table = text.split(table_header, 1)[1].split("\n\n", 1)[0]
    (best,) = re.findall(r"^\| \*\*([0-9.e-]+)\*\*", table, flags=re.M)
    return float(best)


def test_recommended_lr_factor_matches_the_documented_sweep():
    sweep = (ROOT / "docs" / "lr_sweep.md").read_text()
    ratio = _best_lr(sweep, "| Gefen lr") / _best_lr(sweep, "| AdamW lr")
    assert integration.RECOMMENDED_LR_FACTORS["gefen"] == pytest.approx(ratio)


# ---------------------------------------------------------------------------------------------- refusals
def test_unknown_optimizer_name_lists_the_choices(tmp_path):
    with pytest.raises(ValueError, match=r"optimizer='adamw' is not supported; choose one of gefen, gefen-muon-hybrid"):
        optimizer_cls_and_kwargs(training_args(tmp_path), "adamw")
    with pytest.raises(ValueError, match="choose one of gefen, gefen-muon-hybrid"):
        parse_optim_args("fused=false", "muon")


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_unknown_override_names_the_key_and_the_valid_ones(tmp_path, optimizer):
    with pytest.raises(TypeError, match=r"got 'momentun', not an option of .*valid options: lr, .*deterministic"):
        optimizer_cls_and_kwargs(training_args(tmp_path), optimizer, momentun=0.9)


@pytest.mark.parametrize(
    ("optimizer", "kwargs", "error", "fragment"),
    [
        ("gefen", {"weight_decay": 0.1}, ValueError, "set TrainingArguments\\(weight_decay=...\\) instead"),
        (HYBRID, {"model": object()}, TypeError, "model= must be the nn.Module given to Trainer, got object"),
        ("gefen", {"recommended_lr": "yes"}, TypeError, "recommended_lr='yes' must be a bool"),
        ("gefen", {"fused": "False"}, TypeError, "fused='False' must be None, True or False"),
        ("gefen", {"deterministic": "false"}, TypeError, "deterministic"),
        ("gefen", {"betas": (0.9, 1.5)}, gefen.ConfigError, "betas"),
        (HYBRID, {"backup_optimizer": "sgd"}, gefen.ConfigError, "backup_optimizer='sgd' must be one of"),
    ],
)
def test_bad_arguments_are_refused_at_the_call(tmp_path, optimizer, kwargs, error, fragment):
    with pytest.raises(error, match=fragment):
        optimizer_cls_and_kwargs(training_args(tmp_path), optimizer, **kwargs)


def test_model_is_refused_for_plain_gefen(tmp_path):
    with pytest.raises(ValueError, match="optimizer='gefen'\\) takes no model=: Trainer passes Gefen its own param"):
        optimizer_cls_and_kwargs(training_args(tmp_path), "gefen", model=tiny_bert())


def test_bad_training_arguments_are_refused_at_the_call(tmp_path):
    with pytest.raises(TypeError, match="has no learning_rate, weight_decay, adam_beta1, adam_beta2, adam_epsilon"):
        optimizer_cls_and_kwargs(object())
    with pytest.raises(gefen.ConfigError, match="eps"):
        optimizer_cls_and_kwargs(training_args(tmp_path, adam_epsilon=0.0))


@pytest.mark.parametrize("missing", ["transformers", "accelerate"])
def test_missing_install_names_the_extra(tmp_path, monkeypatch, missing):
    args = training_args(tmp_path)
    monkeypatch.setitem(sys.modules, missing, None)  # makes `import <missing>` raise ImportError
    with pytest.raises(ImportError, match=rf"needs {missing}, .*pip install gefen\[hf\]"):
        optimizer_cls_and_kwargs(args)


def test_hybrid_needs_trainers_factory_protocol(tmp_path, monkeypatch):
    args = training_args(tmp_path)
    monkeypatch.setitem(sys.modules, "transformers.trainer_optimizer", None)
    with pytest.raises(ImportError, match=r"optimizer-factory protocol .* Trainer\(optimizers="):
        optimizer_cls_and_kwargs(args, HYBRID)
    assert optimizer_cls_and_kwargs(args)[0] is TrainerGefen  # plain Gefen does not need it


@pytest.mark.slow  # a fresh interpreter imports torch: ~3-6 s
def test_importing_the_integration_does_not_import_transformers():
    code = (
        "import sys, gefen, gefen.integrations.transformers as t\n"
        "assert t.parse_optim_args('fused=false') == {'fused': False}\n"
        "print(sorted(m for m in ('transformers', 'accelerate') if m in sys.modules))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120, check=True
    )
    assert out.stdout.strip() == "[]"


# ---------------------------------------------------------------------------------------------- optim_args
@pytest.mark.parametrize(
    ("text", "optimizer", "expected"),
    [
        ("fused=false,deterministic=true", "gefen", {"fused": False, "deterministic": True}),
        ("fused=False, deterministic=TRUE", "gefen", {"fused": False, "deterministic": True}),
        ("fused=no,deterministic=Yes,capturable=0,factored_v_2d=1", "gefen", None),
        ("fused=none", "gefen", {"fused": None}),
        ("fused=NONE,nonfinite=None", "gefen", {"fused": None, "nonfinite": None}),
        ("lr=3e-4, eps=1e-7, weight_decay=0", "gefen", {"lr": 3e-4, "eps": 1e-7, "weight_decay": 0.0}),
        ("betas=(0.9,0.95)", "gefen", {"betas": (0.9, 0.95)}),
        ("betas=[0.8, 0.99]", "gefen", {"betas": (0.8, 0.99)}),
        ("nonfinite=raise", "gefen", {"nonfinite": "raise"}),
        ("nonfinite='raise'", "gefen", {"nonfinite": "raise"}),
        ("ns_steps=3,normuon=false,backup_lr=none", HYBRID, {"ns_steps": 3, "normuon": False, "backup_lr": None}),
        ("backup_optimizer=adamw,backup_lr=1e-4", HYBRID, {"backup_optimizer": "adamw", "backup_lr": 1e-4}),
        ("backup_substrings=(embed, lm_head)", HYBRID, {"backup_substrings": ("embed", "lm_head")}),
        ("ns_schedule=tuned4", HYBRID, {"ns_schedule": "tuned4"}),
        ("ns_schedule=none", HYBRID, {"ns_schedule": None}),
        (
            "ns_schedule=((3.4,-4.7,2.0),(3,-3.2,1.2)),momentum=0.9",
            HYBRID,
            {"ns_schedule": ((3.4, -4.7, 2.0), (3.0, -3.2, 1.2)), "momentum": 0.9},
        ),
        ("", "gefen", {}),
        ("   ", "gefen", {}),
        (None, "gefen", {}),
    ],
)
def test_parse_optim_args_coerces_to_the_constructors_types(text, optimizer, expected):
    if expected is None:
        expected = {"fused": False, "deterministic": True, "capturable": False, "factored_v_2d": True}
    parsed = parse_optim_args(text, optimizer)
    assert parsed == expected
    assert [type(v) for v in parsed.values()] == [type(v) for v in expected.values()]  # 1 -> True, not 1


def test_parse_optim_args_never_keeps_a_false_string():
    parsed = parse_optim_args("fused=False,deterministic=False")
    assert parsed["fused"] is False and parsed["deterministic"] is False


@pytest.mark.parametrize(
    ("text", "optimizer", "fragments"),
    [
        ("fused=maybe", "gefen", ["fused='maybe' is not accepted", "true/false/1/0/yes/no", "or none"]),
        ("deterministic=2", "gefen", ["deterministic='2' is not accepted", "true/false/1/0/yes/no"]),
        ("deterministic=none", "gefen", ["deterministic='none' is not accepted"]),
        ("fuzed=true", "gefen", ["unknown option 'fuzed' for Gefen", "valid options: lr, betas", "fused"]),
        ("factored_v_2d=true", HYBRID, ["unknown option 'factored_v_2d' for GefenMuonHybrid", "backup_lr"]),
        ("fused", "gefen", ["malformed pair 'fused'", "key=value"]),
        ("=true", "gefen", ["malformed pair '=true'"]),
        ("fused=", "gefen", ["malformed pair 'fused='"]),
        ("fused=true,,deterministic=true", "gefen", ["malformed pair ''"]),
        ("fused=true,", "gefen", ["malformed pair ''"]),
        ("fused=true,fused=false", "gefen", ["'fused' is given twice ('true' and 'false')"]),
        ("lr=fast", "gefen", ["lr='fast' is not accepted", "a finite number"]),
        ("lr=nan", "gefen", ["lr='nan' is not accepted", "a finite number"]),
        ("lr=inf", "gefen", ["lr='inf' is not accepted"]),
        ("ns_steps=2.5", HYBRID, ["ns_steps='2.5' is not accepted", "an integer"]),
        ("betas=0.9", "gefen", ["betas='0.9' is not accepted", "bracketed tuple of 2"]),
        ("betas=(0.9)", "gefen", ["betas='(0.9)' is not accepted"]),
        ("betas=(0.9,0.95,0.99)", "gefen", ["betas='(0.9,0.95,0.99)' is not accepted"]),
        ("betas=(0.9,x)", "gefen", ["betas='(0.9,x)' is not accepted"]),
        ("betas=(0.9,0.95", "gefen", ["a bracket is not closed"]),
        ("betas=0.9,0.95)", "gefen", ["unbalanced ')'"]),
        ("betas=(0.9,0.95]", "gefen", ["unbalanced ']'"]),
        ("betas=(0.9,,0.95)", "gefen", ["has an empty element"]),
        ("nonfinite=ra(ise", "gefen", ["a bracket is not closed"]),
        ("nonfinite=rai)se", "gefen", ["unbalanced ')'"]),
        ("backup_substrings=embed", HYBRID, ["backup_substrings='embed' is not accepted", "bracketed tuple"]),
    ],
)
def test_parse_optim_args_refusals_name_key_value_and_what_is_accepted(text, optimizer, fragments):
    with pytest.raises(ValueError) as caught:
        parse_optim_args(text, optimizer)
    message = str(caught.value)
    assert message.startswith(f"optim_args {text!r}")
    for fragment in fragments:
        assert fragment in message


def test_parse_optim_args_refuses_a_non_string():
    with pytest.raises(TypeError, match="needs a string, got dict"):
        parse_optim_args({"fused": False})


def test_parsed_optim_args_pass_through_to_the_optimizer(tmp_path):
    args = training_args(tmp_path, optim_args="fused=false, deterministic=true, betas=(0.8,0.9)")
    pair = optimizer_cls_and_kwargs(args, **parse_optim_args(args.optim_args))
    optimizer = Trainer(model=tiny_bert(), args=args, train_dataset=dataset(), optimizer_cls_and_kwargs=pair)
    optimizer = optimizer.create_optimizer()
    assert optimizer.deterministic is True
    assert all(g["fused"] is False and g["betas"] == (0.8, 0.9) for g in optimizer.param_groups)


# ---------------------------------------------------------------------------------------------- Trainer runs
@pytest.mark.slow
@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_trainer_trains_with_bf16_accumulation_and_warmup(tmp_path, optimizer):
    steps = 12
    args = training_args(tmp_path, max_steps=steps, bf16=True, learning_rate=1e-2)
    model = tiny_bert()
    trainer = make_trainer(model, args, optimizer)
    assert trainer.accelerator.mixed_precision == "bf16"  # autocast on the CPU
    trainer.train()

    logs = [h for h in trainer.state.log_history if "loss" in h]
    losses = [h["loss"] for h in logs]
    assert len(losses) == steps
    assert losses[-1] < 0.75 * losses[0], losses  # 16 rows = one optimizer step's batch: the same data each step
    lrs = [h["learning_rate"] for h in logs]
    assert lrs[0] < max(lrs) == pytest.approx(1e-2) and lrs[-1] < max(lrs)  # warmup then linear decay

    inner = trainer.optimizer.optimizer  # accelerate's wrapper around ours
    children = inner._children() if isinstance(inner, gefen.GefenMuonHybrid) else [inner]
    assert [type(c).__name__ for c in children] == (
        ["TrainerGefen"] if optimizer == "gefen" else ["GefenMuon", "Gefen"]
    )
    assert [c.global_step for c in children] == [steps] * len(children)  # one update per 2 micro-batches
    weight = model.bert.encoder.layer[0].attention.self.query.weight
    state = inner.state[weight]
    assert state["first_moment_codes"].dtype == torch.uint8 and state["first_moment_codes"].shape == weight.shape
    assert int(state["step"]) == steps
    assert weight.dtype == torch.float32  # bf16 only in autocast, master weights stay fp32


def _flat(obj, prefix=""):
    """``{path: leaf}`` of a nested state dict, for a bit-for-bit comparison."""
    if isinstance(obj, dict):
        return {k: v for key, value in obj.items() for k, v in _flat(value, f"{prefix}/{key}").items()}
    if isinstance(obj, (list, tuple)):
        return {k: v for i, value in enumerate(obj) for k, v in _flat(value, f"{prefix}/{i}").items()}
    return {prefix: obj}


def _assert_bit_identical(a, b):
    flat_a, flat_b = _flat(a), _flat(b)
    assert flat_a.keys() == flat_b.keys()
    for key, value in flat_a.items():
        other = flat_b[key]
        if isinstance(value, torch.Tensor):
            assert value.dtype == other.dtype and torch.equal(value, other), key
        else:
            assert value == other, key


@pytest.mark.slow
@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_trainer_resume_from_checkpoint_is_bit_identical(tmp_path, optimizer):
    settings = {"max_steps": 4, "per_device_train_batch_size": 4, "save_steps": 2}  # 32 rows: 4 steps = 1 epoch
    args = training_args(tmp_path, save_strategy="steps", **settings)
    baseline = make_trainer(tiny_bert(), args, optimizer, rows=32)
    baseline.train()
    checkpoint = tmp_path / "out" / "checkpoint-2"  # mid-epoch: resume skips the batches already seen
    assert (checkpoint / "optimizer.pt").is_file()

    resumed_args = training_args(tmp_path, output_dir=str(tmp_path / "resumed"), **settings)
    resumed = make_trainer(tiny_bert(seed=5), resumed_args, optimizer, rows=32)
    resumed.train(resume_from_checkpoint=str(checkpoint))

    assert resumed.state.global_step == baseline.state.global_step == 4
    _assert_bit_identical(resumed.model.state_dict(), baseline.model.state_dict())
    _assert_bit_identical(resumed.optimizer.optimizer.state_dict(), baseline.optimizer.optimizer.state_dict())
    # the resumed history is the checkpoint's (steps 1-2) followed by its own steps 3-4: all equal the baseline's
    history = [[(h["step"], h["loss"]) for h in t.state.log_history if "loss" in h] for t in (baseline, resumed)]
    assert [step for step, _ in history[1]] == [1, 2, 3, 4]
    assert history[1] == history[0]


# ---------------------------------------------------------------------------------------------- Accelerate
@pytest.mark.slow
@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_accelerate_steps_only_on_sync_steps(optimizer):
    from accelerate import Accelerator
    from torch.utils.data import DataLoader

    accelerator = Accelerator(gradient_accumulation_steps=2, cpu=True)
    model = tiny_bert()
    lr = 3e-3
    if optimizer == "gefen":
        opt = gefen.Gefen(model.named_parameters(), lr=lr, weight_decay=0.01, fused=False)
    else:
        opt = gefen.GefenMuonHybrid(model, lr=lr, muon_weight_decay=0.01, fused=False)
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: min(1.0, (step + 1) / 3))  # linear warmup
    loader = DataLoader(dataset(32), batch_size=4)  # 8 micro-batches -> 4 optimizer steps
    model, wrapped, loader, scheduler = accelerator.prepare(model, opt, loader, scheduler)
    children = opt._children() if isinstance(opt, gefen.GefenMuonHybrid) else [opt]
    weight = model.bert.encoder.layer[0].attention.self.query.weight

    syncs, steps, lrs, moved, losses = [], [], [], [], []
    for batch in loader:
        before = weight.detach().clone()
        with accelerator.accumulate(model):
            loss = model(**batch).loss
            accelerator.backward(loss)
            wrapped.step()
            scheduler.step()
            wrapped.zero_grad()
        syncs.append(accelerator.sync_gradients)
        steps.append([c.global_step for c in children])
        lrs.append(opt.param_groups[0]["lr"])
        moved.append(not torch.equal(before, weight))
        losses.append(loss.item())

    assert syncs == [False, True] * 4
    assert steps == [[i // 2] * len(children) for i in range(1, 9)]
    assert moved == syncs  # the weights change on sync steps only
    assert lrs == pytest.approx([lr * f for f in (1 / 3, 2 / 3, 2 / 3, 1, 1, 1, 1, 1)])
    assert not wrapped.step_was_skipped
