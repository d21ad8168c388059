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
    "tests/engine/test_default_model.py": 78,
    "tests/agents/test_clis.py": 76,
    "tests/engine/test_engine_restart.py": 65,
    "tests/bench/test_bench_gpu_rehearsal.py": 34,
    "tests/api/test_ui_browser.py": 32,
    "tests/api/test_host_kv_restart_server.py": 28,
    "tests/agents/test_agent_model.py": 28,
    "tests/api/test_formats_server.py": 28,
    "tests/api/test_forced_calls.py": 26,
    "tests/api/test_robustness_fuzz.py": 25,
    "tests/bench/test_bench_peers.py": 24,
    "tests/bench/test_soak_abuse.py": 23,
    "tests/api/test_tools_e2e.py": 21,
    "tests/engine/test_hybrid_prefix_cache.py": 21,
    "tests/api/test_host_kv_hybrid_server.py": 20,
    "tests/api/test_vllm_router.py": 20,
    "tests/bench/test_soak.py": 18,
    "tests/engine/test_engine_restart_edges.py": 18,
    "tests/kernels/test_nvfp4_matmul.py": 17,
    "tests/engine/test_engine_proc.py": 16,
    "tests/bench/test_bench_e2e.py": 16,
    "tests/api/test_host_kv_events_server.py": 15,
    "tests/engine/test_hybrid_correctness.py": 15,
    "tests/api/test_team_server.py": 15,
    "tests/api/test_response_format.py": 15,
    "tests/engine/test_moe_server.py": 15,
    "tests/api/test_data_parallel_server.py": 14,
    "tests/engine/test_demo_model.py": 14,
    "tests/api/test_security_http.py": 14,
    "tests/engine/test_hybrid_server.py": 13,
    "tests/bench/test_lm_eval.py": 13,
    "tests/api/test_api_server.py": 13,
    "tests/api/test_vllm_compat_server.py": 13,
    "tests/engine/test_host_kv_engine.py": 13,
    "tests/engine/test_spec_decode.py": 12,
    "tests/api/test_robustness_server.py": 12,
    "tests/api/test_compact_output_e2e.py": 12,
    "tests/engine/test_hybrid_moe.py": 12,
    "tests/engine/test_fp8_engine.py": 12,
    "tests/engine/test_structured.py": 11,
    "tests/engine/test_spec_mtp.py": 10,
    "tests/bench/test_bench_serve.py": 10,
    "tests/engine/test_hybrid_kv_events_server.py": 10,
    "tests/kernels/test_fp8_kernels.py": 10,
    "tests/api/test_vllm_structured_outputs.py": 10,
    "tests/engine/test_start_cost.py": 9,
    "tests/api/test_robustness_shutdown.py": 9,
    "tests/engine/test_tokenizer_tools.py": 9,
    "tests/api/test_responses_api.py": 8,
    "tests/api/test_api_robustness.py": 8,
    "tests/engine/test_hybrid_prefix_server.py": 8,
    "tests/test_layering.py": 7,
    "tests/api/test_agent_openai.py": 7,
    "tests/bench/test_bench_moe.py": 7,
    "tests/engine/test_moe_engine.py": 6,
    "tests/api/test_completions_echo.py": 6,
    "tests/engine/test_spec_mtp_server.py": 6,
    "tests/engine/test_spec_decode_server.py": 6,
    "tests/engine/test_grammar_cache.py": 6,
    "tests/engine/test_engine_e2e.py": 6,
    "tests/engine/test_spec_mtp_folder.py": 6,
    "tests/engine/test_gguf_moe_hybrid.py": 6,
    "tests/api/test_parsers_splits.py": 6,
    "tests/api/test_shutdown_while_loading.py": 5,
    "tests/api/test_robustness_engine.py": 5,
    "tests/api/test_ui_page.py": 5,
    "tests/engine/test_moe_nvfp4.py": 5,
    "tests/api/test_agent_template.py": 5,
    "tests/engine/test_hybrid_nvfp4.py": 5,
    "tests/api/test_agent_messages.py": 4,
    "tests/engine/test_engine_correctness.py": 4,
    "tests/engine/test_nvfp4_engine.py": 4,
    "tests/api/test_tokenize_api.py": 3,
    "tests/api/test_ui_usage.py": 3,
    "tests/bench/test_bench_offline.py": 3,
    "tests/api/test_messages_errors.py": 3,
    "tests/api/test_vllm_structural_tag.py": 3,
    "tests/api/test_messages_api.py": 2,
    "tests/kernels/test_fused_moe.py": 2,
    "tests/engine/test_cuda_graph_hybrid.py": 2,
    "tests/engine/test_data_parallel_config.py": 2,
    "tests/engine/test_input_processor.py": 2,
    "tests/engine/test_data_parallel.py": 2,
    "tests/tools/test_cli_commands.py": 2,
    "tests/kernels/test_cpu_gemv.py": 2,
    "tests/api/test_agent_units.py": 2,
    "tests/api/test_parsers_json_stream.py": 2,
    "tests/api/test_tool_grammar.py": 2,
    "tests/kernels/test_cpu_attention.py": 2,
    "tests/tools/test_bundle.py": 1,
    "tests/bench/test_bench_context.py": 1,
    "tests/engine/test_moe_graph.py": 1,
    "tests/scheduler/test_checkpoint_workloads.py": 1,
    "tests/api/test_robustness_admission.py": 1,
    "tests/engine/test_int8_linear.py": 1,
    "tests/engine/test_gguf.py": 1,
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
