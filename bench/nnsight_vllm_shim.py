"""nnsight's VLLM on vLLM's CPU build, nnsight itself unpatched (no edits to site-packages).

nnsight 0.8.1 names vLLM's GPU worker as `worker_cls` (nnsight.modeling.vllm.vllm.VLLM._WORKER_CLS), whose
init_device raises "Not support device type: cpu" on the CPU build. This module defines a worker that is vLLM's
`CPUWorker` with nnsight's runner mixed into vLLM's `CPUModelRunner` (nnsight's runner overrides load_model,
execute_model, ... and calls super(), so the mix runs the CPU runner underneath), plus nnsight's four worker RPC
methods borrowed from its GPU worker. Importing this module replaces exactly one thing: `VLLM._WORKER_CLS`
(a class attribute, in this process) now names the CPU worker below; vLLM's spawned workers import this module
by that name (the repository root or bench/ must be on their sys.path, which spawn inherits).

    import nnsight_vllm_shim  # or: from bench import nnsight_vllm_shim
    from nnsight.modeling.vllm import VLLM
    model = VLLM(folder, tensor_parallel_size=2, dtype="float32", dispatch=True)
"""
from nnsight.modeling.vllm.model_runners.GPUModelRunner import NNsightGPUModelRunner
from nnsight.modeling.vllm.vllm import VLLM
from nnsight.modeling.vllm.workers.GPUWorker import NNsightGPUWorker
from vllm.v1.worker.cpu_model_runner import CPUModelRunner
from vllm.v1.worker.cpu_worker import CPUWorker


class NNsightCPUModelRunner(NNsightGPUModelRunner, CPUModelRunner):
    """nnsight's runner over vLLM's CPU runner (MRO: nnsight's, CPUModelRunner, GPUModelRunner)."""


class NNsightCPUWorker(CPUWorker):
    """vLLM's CPU worker whose runner interleaves nnsight's interventions."""

    def init_device(self) -> None:
        super().init_device()
        if type(self.model_runner) is not CPUModelRunner:
            raise NotImplementedError(f"nnsight CPU shim: expected CPUModelRunner, got {type(self.model_runner)}")
        self.model_runner.__class__ = NNsightCPUModelRunner

    collect_nnsight = NNsightGPUWorker.collect_nnsight
    nnsight_request_count = NNsightGPUWorker.nnsight_request_count
    nnsight_register = NNsightGPUWorker.nnsight_register
    nnsight_clear_registered = NNsightGPUWorker.nnsight_clear_registered


VLLM._WORKER_CLS = f"{__name__}.NNsightCPUWorker"
