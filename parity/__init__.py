"""The vLLM 0.33 parity harness (issue 25; docs/parity.md).

vLLM's real v1 scheduler and engined's `Engine` run the same request streams step by step;
`python -m parity` compares their traces. `scenario` and `trace` use only msgspec and the
stdlib, because `vllm_side` imports them inside the vLLM venv, where engined is absent.
"""
