# Two entry points for a fresh machine (see README): `make demo` and `make test`.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
EXTRAS ?= builder,ort,audio,compare,rtx,gpu,serve,cluster,test
DEMO_TEXT ?= Hello! This is Higgs Audio on a tiny random checkpoint.

.PHONY: demo test install clean

install: $(VENV)/.installed

# torch==2.13.0 first: where a CPU wheel of it is on local disk pip takes that one, else PyPI's.
$(VENV)/.installed: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[$(EXTRAS)]'
	@# TensorRT-RTX 1.7's parser dlopen()s libtensorrt_rtx.so, but its wheel ships only the .so.1 (plugins/rtx_build.py)
	$(BIN)/python -c "import importlib.util as u, os; d = next(iter(u.find_spec('tensorrt_rtx_libs').submodule_search_locations)); l = os.path.join(d, 'libtensorrt_rtx.so'); os.path.lexists(l) or os.symlink('libtensorrt_rtx.so.1', l)"
	touch $@

# export → build (TensorRT-RTX for SM89: no GPU needed) → run → wav. The RTX plans cannot run on this machine, so the
# run uses ONNX Runtime on the same engine directory's reference graphs; with TensorRT and a GPU: TARGET= BACKEND=trt.
TARGET ?= sm89
BACKEND ?= ort
demo: install
	$(BIN)/higgs-trt tiny-checkpoint out/tiny-checkpoint
	$(BIN)/higgs-trt build --checkpoint out/tiny-checkpoint --out engines/tiny --recipe tiny $(if $(TARGET),--target $(TARGET))
	$(BIN)/higgs-trt run --engine engines/tiny --backend $(BACKEND) --text "$(DEMO_TEXT)" --out out/demo.wav

# Test files spread over the CPUs (up to 4 workers), each file on one worker: its module fixtures built once there;
# the session fixtures (tiny checkpoint, exported engines) are built once for all workers (tests/conftest.py).
test: install
	$(BIN)/python -m pytest -q -n auto --maxprocesses 4 --dist loadfile

clean:
	rm -rf out .pytest_cache
