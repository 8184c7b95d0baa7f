"""What of each engine cache module cannot run on a CPU-only machine: ``radixspec fuzz --coverage`` gives each
module's coverage of the rest too (fuzz/engine_coverage.py), the issue's measure of reach.

By qualified name (``Class.method``), each with its reason: ``cuda`` (a device, stream or pinned memory),
``kernel`` (a Triton or compiled kernel with no CPU path), ``distributed`` (a process group of several ranks),
``external`` (a service or library a CPU machine cannot have). Listed only where every call needs it: a function
with a CPU path, an optional CUDA branch or a guard that returns on one rank is not listed, and its lines count.
Read from SGLang 0.5.23 and vLLM 0.33.0 (2026-12-07); a test checks each name against the installed engine, and
``--coverage`` names a listed function that ran (it named ``MHATokenToKVPoolHost``'s two transfers, listed first: the
HiCache target runs them). vLLM's modules here (block pool, prefix hashes, coordinator,
managers, offloading managers and the connectors' scheduler side) are scheduler-side Python: nothing is listed.
"""

CPU_UNREACHABLE: dict[str, dict[str, str]] = {
    "sglang.srt.mem_cache.allocator.swa": {
        "SWATokenToKVPoolAllocator._free_swa_pages_cuda": "kernel: Triton get_and_clear_swa_pages_kernel",
    },
    "sglang.srt.mem_cache.pool_host.mha": {
        "MHATokenToKOnlyPoolHost.load_to_device_per_layer": "kernel: sgl_kernel.kvcacheio or JIT CUDA MLA kernels",
        "MHATokenToKOnlyPoolHost.backup_from_device_all_layer": "kernel: sgl_kernel.kvcacheio or JIT CUDA MLA kernels",
        "HiSparseMHATokenToKVPoolHost.__init__": "cuda: pins its host buffer (cudaHostRegister), pin_memory fixed on",
        "HiSparseMHATokenToKVPoolHost.load_to_device_per_layer": "kernel: sgl_kernel.kvcacheio transfer",
        "HiSparseMHATokenToKVPoolHost.backup_from_device_all_layer": "kernel: sgl_kernel.kvcacheio transfer",
        "AsymmetricMHATokenToKVPoolHost.load_to_device_per_layer": "kernel: sgl_kernel.kvcacheio MLA page-first ops",
        "AsymmetricMHATokenToKVPoolHost.backup_from_device_all_layer": "kernel: sgl_kernel.kvcacheio or JIT CUDA",
    },
}
