"""Seconds each test file took in a measured `make test` (the sum of its tests' junit times, setup
included), so tests/conftest.py can hand the heaviest files to the xdist workers first.

With `--dist loadfile` a worker runs whole files and the run ends when the busier worker does; a
heavy file taken last leaves the other worker idle to the end. A file not listed counts as 0
(it runs after the listed ones). Refresh after the suite changes shape:
`pytest -n 2 --dist loadfile --junitxml=run.xml` then `python -m tests.durations run.xml`."""

from __future__ import annotations

import sys
import xml.etree.ElementTree as ET
from collections import Counter

FILE_SECONDS: dict[str, float] = {
    "tests/engine/test_default_model.py": 411,
    "tests/engine/test_engine_restart.py": 359,
    "tests/agents/test_clis.py": 234,
    "tests/bench/test_bench_gpu_rehearsal.py": 156,
    "tests/api/test_formats_server.py": 140,
    "tests/agents/test_agent_model.py": 86,
    "tests/api/test_robustness_fuzz.py": 80,
    "tests/engine/test_engine_proc.py": 60,
    "tests/api/test_ui_browser.py": 60,
    "tests/api/test_host_kv_restart_server.py": 59,
    "tests/api/test_api_robustness.py": 57,
    "tests/api/test_vllm_router.py": 57,
    "tests/api/test_tools_e2e.py": 53,
    "tests/bench/test_soak.py": 52,
    "tests/bench/test_soak_abuse.py": 45,
    "tests/engine/test_moe_server.py": 45,
    "tests/api/test_forced_calls.py": 44,
    "tests/engine/test_hybrid_prefix_cache.py": 40,
    "tests/api/test_api_server.py": 39,
    "tests/api/test_vllm_compat_server.py": 39,
    "tests/bench/test_bench_e2e.py": 38,
    "tests/engine/test_spec_decode.py": 38,
    "tests/api/test_team_server.py": 37,
    "tests/api/test_robustness_shutdown.py": 36,
    "tests/api/test_data_parallel_server.py": 33,
    "tests/api/test_security_http.py": 33,
    "tests/bench/test_lm_eval.py": 33,
    "tests/bench/test_bench_peers.py": 32,
    "tests/api/test_robustness_server.py": 32,
    "tests/api/test_host_kv_hybrid_server.py": 32,
    "tests/engine/test_host_kv_engine.py": 31,
    "tests/api/test_compact_output_e2e.py": 31,
    "tests/api/test_robustness_engine.py": 31,
    "tests/engine/test_hybrid_server.py": 30,
    "tests/api/test_agent_units.py": 29,
    "tests/engine/test_hybrid_prefix_server.py": 29,
    "tests/api/test_host_kv_events_server.py": 28,
    "tests/api/test_response_format.py": 27,
    "tests/engine/test_tokenizer_tools.py": 27,
    "tests/api/test_responses_api.py": 26,
    "tests/engine/test_demo_model.py": 25,
    "tests/kernels/test_nvfp4_matmul.py": 25,
    "tests/engine/test_structured.py": 25,
    "tests/engine/test_fp8_engine.py": 24,
    "tests/engine/test_spec_mtp_server.py": 24,
    "tests/engine/test_hybrid_correctness.py": 23,
    "tests/api/test_agent_openai.py": 23,
    "tests/api/test_vllm_structured_outputs.py": 22,
    "tests/api/test_completions_echo.py": 22,
    "tests/engine/test_hybrid_moe.py": 20,
    "tests/kernels/test_fp8_kernels.py": 20,
    "tests/api/test_tokenize_api.py": 19,
    "tests/api/test_messages_errors.py": 19,
    "tests/api/test_agent_messages.py": 17,
    "tests/engine/test_grammar_cache.py": 15,
    "tests/api/test_ui_usage.py": 15,
    "tests/api/test_ui_page.py": 14,
    "tests/engine/test_spec_mtp.py": 14,
    "tests/api/test_parsers_splits.py": 11,
    "tests/api/test_messages_api.py": 11,
    "tests/engine/test_gguf_moe_hybrid.py": 10,
    "tests/bench/test_bench_serve.py": 10,
    "tests/test_layering.py": 10,
    "tests/engine/test_engine_correctness.py": 9,
    "tests/engine/test_spec_decode_server.py": 9,
    "tests/bench/test_bench_offline.py": 8,
    "tests/engine/test_input_processor.py": 8,
    "tests/engine/test_spec_mtp_folder.py": 7,
    "tests/engine/test_moe_engine.py": 7,
    "tests/bench/test_bench_moe.py": 7,
    "tests/engine/test_engine_e2e.py": 6,
    "tests/api/test_agent_template.py": 5,
    "tests/engine/test_nvfp4_engine.py": 5,
    "tests/engine/test_moe_nvfp4.py": 4,
    "tests/engine/test_hybrid_nvfp4.py": 4,
    "tests/engine/test_cuda_graph_hybrid.py": 4,
    "tests/engine/test_int8_linear.py": 3,
    "tests/engine/test_data_parallel_config.py": 3,
    "tests/api/test_parsers_json_stream.py": 3,
    "tests/tools/test_cli_commands.py": 3,
    "tests/engine/test_gguf.py": 3,
    "tests/api/test_tool_grammar.py": 3,
    "tests/engine/test_data_parallel.py": 2,
    "tests/kernels/test_cpu_gemv.py": 2,
    "tests/kernels/test_fused_moe.py": 2,
    "tests/tools/test_bundle.py": 2,
    "tests/api/test_robustness_admission.py": 2,
    "tests/engine/test_prompt_logprobs.py": 2,
    "tests/engine/test_moe_graph.py": 2,
    "tests/scheduler/test_block_manager.py": 2,
    "tests/bench/test_bench_host_step.py": 2,
    "tests/kernels/test_nvfp4_scale_search.py": 1,
    "tests/kernels/test_cpu_attention.py": 1,
    "tests/scheduler/test_fair_queue.py": 1,
}


def file_seconds(junit_xml: str) -> dict[str, float]:
    """Per test file (its path from the repository root), the sum of its testcases' times."""
    seconds: Counter[str] = Counter()
    for case in ET.parse(junit_xml).getroot().iter("testcase"):
        module = (case.get("classname") or "").split("::")[0]
        # classname is dotted (tests.agents.test_clis or tests.test_x.TestClass): the file is the
        # longest prefix that names a test_*.py module.
        parts = module.split(".")
        index = max((i for i, part in enumerate(parts) if part.startswith("test_")), default=len(parts) - 1)
        seconds["/".join(parts[: index + 1]) + ".py"] += float(case.get("time") or 0.0)
    return dict(seconds)


if __name__ == "__main__":
    table = sorted(file_seconds(sys.argv[1]).items(), key=lambda item: -item[1])
    print("FILE_SECONDS: dict[str, float] = {")
    for path, total in table:
        if total >= 1.0:
            print(f'    "{path}": {total:.0f},')
    print("}")
