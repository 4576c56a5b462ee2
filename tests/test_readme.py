"""Every command and code block of README.md is exercised somewhere, and every link in README.md and docs/ resolves.

* Python blocks run here, in-process (CPU, small), unless listed in ``PYTHON_ELSEWHERE`` with the test that runs them.
* Shell commands (lines of ```bash blocks, and inline code spans that start with a command word) must be listed,
  verbatim, in ``COMMANDS`` with the runner that exercises them: a test (``path`` or ``path::function``), a script
  or the CI entry point. The runners are checked to exist, so a new README command without a runner fails here.
"""

from __future__ import annotations

import re
import warnings
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
#: False in the release gate's copy (tests/, docs/, README.md and a few more, no scripts/ or .ci/): there only the
#: runners under tests/ can be checked. Nothing here is skipped (the gate refuses skips not marked cuda).
IN_CHECKOUT = (ROOT / ".ci" / "run").is_file()

#: Verbatim README command -> the runners that exercise it (at the README's size or a smaller one).
COMMANDS: dict[str, list[str]] = {
    "bash scripts/demo.sh": [
        "scripts/setup.sh",
        ".ci/run",
        "tests/cli/test_demo.py::test_demo_runs_gefen",
        "tests/test_readme.py::test_demo_script_is_setup_then_gefen_demo",
    ],
    "bash scripts/demo.sh --steps 50 --plot demo.png": [
        "tests/cli/test_demo.py::test_demo_plot_is_a_png",
        "tests/test_readme.py::test_demo_script_is_setup_then_gefen_demo",
    ],
    "bash scripts/test.sh": [".ci/run"],
    "bash scripts/setup.sh demo": ["scripts/setup.sh", ".ci/run"],
    'pip install -c constraints.txt -e ".[demo,test,hf]"': ["scripts/setup.sh", ".ci/run"],
    "pip install gefen[hf]": ["scripts/release_check.sh"],  # installs the wheel with its extras
    "gefen inspect run/optimizer.pt": [
        "tests/cli/test_inspect.py::test_inspect_text_report_of_a_good_checkpoint",
        "tests/cli/test_inspect.py::test_inspect_reads_trainer_folder",
    ],
    "gefen inspect run/optimizer.pt --json": [
        "tests/cli/test_inspect.py::test_inspect_accepts_gefen_checkpoint_with_live_values"
    ],
    "torchrun --nproc-per-node 2 examples/ddp_train.py": [
        "tests/distributed/test_ddp.py::test_ddp_example_runs_with_torchrun"
    ],
    "torchrun --nproc-per-node 2 examples/fsdp2_train.py --save ckpt.pt": [
        "tests/distributed/test_fsdp2.py::test_fsdp2_example_trains_saves_and_resumes_on_another_world_size"
    ],
    "torchrun --nproc-per-node 3 examples/fsdp2_train.py --resume ckpt.pt": [
        "tests/distributed/test_fsdp2.py::test_fsdp2_example_trains_saves_and_resumes_on_another_world_size"
    ],
    "gefen find-lr": ["tests/cli/test_find_lr.py::test_cli_compare_adamw_writes_sane_json_and_plot"],
    "gefen demo --json out.json --plot demo.png": [
        "tests/cli/test_demo.py::test_demo_json_has_documented_keys_and_sane_values",
        "tests/cli/test_demo.py::test_demo_plot_is_a_png",
    ],
    "gefen demo": ["tests/cli/test_demo.py::test_demo_runs_gefen"],
    "gefen capacity": ["tests/cli/test_capacity.py::test_command_end_to_end_on_a_small_budget"],
    "gefen demo --optimizers adamw,gefen-muon-hybrid,torch-muon-hybrid --seed 1": [
        "tests/cli/test_demo.py::test_demo_same_seed_gives_identical_losses"
    ],
    "gefen demo --help": ["tests/test_readme.py::test_gefen_demo_help"],
    "gefen capacity --budget-gib 1 2 4 8 --json capacity.json --plot capacity.png": [
        "tests/cli/test_capacity.py::test_command_end_to_end_on_a_small_budget"
    ],
    "gefen capacity --budget-gib 8 --json cap.json": [
        "tests/cli/test_capacity.py::test_command_end_to_end_on_a_small_budget"
    ],
    "gefen capacity --device cuda --budget-gib 16 40 80": ["scripts/gpu_check.sh"],
    "gefen capacity --device cuda": ["scripts/gpu_check.sh"],
    "bash scripts/release_check.sh": [".ci/run"],
}

#: First line of a Python block that is not run here -> the tests that run its code.
PYTHON_ELSEWHERE: dict[str, list[str]] = {
    "from transformers import Trainer, TrainingArguments": [
        "tests/integrations/test_transformers.py::test_trainer_trains_with_bf16_accumulation_and_warmup",
        "tests/integrations/test_transformers.py::test_trainer_resume_from_checkpoint_is_bit_identical",
    ],
}

_COMMAND_WORDS = ("bash ", "gefen ", "torchrun ", "pip ", "python ", "python3 ")
_FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)


def _text() -> str:
    return README.read_text(encoding="utf-8")


def readme_python_blocks() -> list[str]:
    return [body for lang, body in _FENCE.findall(_text()) if lang == "python"]


def readme_commands() -> list[str]:
    """Every shell command of the README: lines of bash blocks (comments stripped) and command-like code spans."""
    text = _text()
    found: list[str] = []
    for lang, body in _FENCE.findall(text):
        if lang in ("bash", "sh", "shell", "console"):
            for line in body.splitlines():
                command = re.sub(r"\s+#.*$", "", line).strip()
                if command and not command.startswith("#"):
                    found.append(command)
    prose = _FENCE.sub("", text)
    for span in re.findall(r"`([^`\n]+)`", prose):
        if span.startswith(_COMMAND_WORDS) or span == "gefen find-lr":
            found.append(span.strip())
    return list(dict.fromkeys(found))


def _runner_exists(runner: str) -> bool:
    path, _, function = runner.partition("::")
    file = ROOT / path
    if not file.is_file():
        return False
    return not function or re.search(rf"^(async )?def {re.escape(function)}\(", file.read_text(), re.M) is not None


def test_every_readme_command_has_a_runner() -> None:
    missing = [command for command in readme_commands() if command not in COMMANDS]
    assert not missing, f"README commands without a runner in tests/test_readme.py COMMANDS: {missing}"


def test_every_runner_named_exists() -> None:
    runners = [r for rs in [*COMMANDS.values(), *PYTHON_ELSEWHERE.values()] for r in rs]
    checkable = [r for r in runners if IN_CHECKOUT or r.startswith("tests/")]
    assert checkable and not [r for r in checkable if not _runner_exists(r)]


def test_the_mapping_holds_no_stale_commands() -> None:
    stale = [command for command in COMMANDS if command not in readme_commands()]
    assert not stale, f"commands no longer in README.md: {stale}"
    firsts = [block.splitlines()[0] for block in readme_python_blocks()]
    assert not [line for line in PYTHON_ELSEWHERE if line not in firsts]


def test_ci_runs_the_readme_test_command_and_the_gate() -> None:
    if not IN_CHECKOUT:
        return  # the gate's copy has no .ci/ (checked in every checkout run)
    lines = (ROOT / ".ci/run").read_text().splitlines()
    assert "bash scripts/test.sh" in lines and "bash scripts/release_check.sh" in lines


def test_demo_script_is_setup_then_gefen_demo() -> None:
    if not IN_CHECKOUT:
        return  # the gate's copy has no scripts/demo.sh (checked in every checkout run)
    lines = [line for line in (ROOT / "scripts/demo.sh").read_text().splitlines() if line and line[0] not in "#"]
    assert any(line.startswith("bash scripts/setup.sh") for line in lines)
    # The start-up the demo reports counts from the script's first line, set-up included.
    setup = next(i for i, line in enumerate(lines) if line.startswith("bash scripts/setup.sh"))
    assert lines.index('GEFEN_DEMO_LAUNCHED_AT="$(date +%s.%N)"') < setup
    assert '.venv/bin/gefen demo "$@"' in lines


def test_gefen_demo_help(capsys: pytest.CaptureFixture[str]) -> None:
    from gefen.cli.main import main

    with pytest.raises(SystemExit) as exit_info:
        main(["demo", "--help"])
    assert exit_info.value.code == 0 and "--plot" in capsys.readouterr().out


def _blocks_run_here() -> list[str]:
    return [block for block in readme_python_blocks() if block.splitlines()[0] not in PYTHON_ELSEWHERE]


@pytest.mark.parametrize("index", range(len(_blocks_run_here())))
def test_readme_python_block_runs(index: int) -> None:
    block = _blocks_run_here()[index]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        exec(compile(block, f"README.md python block {index}", "exec"), {"__name__": "__readme__"})


def _links(path: Path) -> list[str]:
    text = _FENCE.sub("", path.read_text(encoding="utf-8"))
    return re.findall(r"\]\(([^)\s]+)\)", text)


@pytest.mark.parametrize("doc", [README, *sorted((ROOT / "docs").glob("*.md"))], ids=lambda p: p.name)
def test_links_point_to_existing_files_and_anchors(doc: Path) -> None:
    broken = []
    for link in _links(doc):
        if re.match(r"[a-z]+:", link):
            continue  # external URL
        target, _, anchor = link.partition("#")
        file = (doc.parent / target).resolve() if target else doc
        if not file.exists():
            broken.append(link)
        elif anchor and file.suffix == ".md" and anchor not in _anchors(file):
            broken.append(link)
    assert not broken, f"{doc.name}: broken links {broken}"


def _anchors(file: Path) -> set[str]:
    """GitHub's heading anchors: lower-case, punctuation dropped, spaces to hyphens."""
    anchors = set()
    for heading in re.findall(r"^#+ (.+)$", _FENCE.sub("", file.read_text(encoding="utf-8")), re.M):
        anchors.add(re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-"))
    return anchors


def test_readme_stays_short() -> None:
    assert len(_text().splitlines()) <= 300
