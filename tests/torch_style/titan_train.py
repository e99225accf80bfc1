"""torchtitan's train entry (``torchtitan.train.main``) on CPU with gloo, with the shims a CPU
run needs, the same whichever DTensor runs it (torch's, or shardtensor's under
``-m shardtensor.dropin``):

- the device is the CPU (torchtitan falls back to "cuda" where no accelerator is found), with no
  device-memory monitor, and its process-group timeout barrier (which passes CUDA ``device_ids``)
  skipped; on torch 2.13 a stand-in for ``torch.distributed.set_timeout``, which it calls;
- FlexAttention has no CPU backward: its forward runs as SDPA with the block mask made dense;
- gloo has no pre-multiplied sum: FSDP reduces with sums (``set_force_sum_reduction_for_comms``);
- with ``TINY_TITAN_NORM64=1`` the gradient norm is also logged in float64 from the whole
  gradients (``grad_norm_f64``): torch's float32 norm depends on how the gradients are split into
  shards (its summation order), by about 1e-4 on this model.

Each logged step is printed as one JSON line with the loss and gradient norm at full precision.
"""
import json
import os
import sys

import torch
import torch._utils
import torch.nn.functional as F

torch._utils._get_available_device_type = lambda: "cpu"
if not hasattr(torch.distributed, "set_timeout"):
    torch.distributed.set_timeout = lambda timeout, group=None: None

import torchtitan.components.metrics as metrics  # noqa: E402
import torchtitan.distributed.fsdp as titan_fsdp  # noqa: E402
import torchtitan.distributed.utils as titan_utils  # noqa: E402
import torchtitan.models.common.attention as attention  # noqa: E402
from torch.nn.attention.flex_attention import create_mask  # noqa: E402


class _NoMemory:
    device_name, device_capacity_gib = "cpu", 0.0

    def reset_peak_stats(self):
        pass

    def get_peak_stats(self):
        return metrics.DeviceMemStats(0, 0, 0, 0, 0, 0)


_norm64 = {}
_clip = titan_utils.clip_grad_norm_


def _clip_logging_f64(parameters, *args, **kwargs):
    parameters = list(parameters)
    squares = 0.0
    for p in parameters:
        if p.grad is not None:
            g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
            squares += float(g.double().square().sum())
    _norm64["grad_norm_f64"] = squares ** 0.5
    return _clip(parameters, *args, **kwargs)


def _print_metrics(self, values, step):
    keep = {k: float(v) for k, v in values.items() if "loss" in k or "grad_norm" in k}
    keep.update(_norm64)
    print(json.dumps({"titan_step": step, "rank": int(os.environ.get("RANK", 0)), **keep}), flush=True)


def _sdpa(self, q_BLNH, k_BLNH, v_BLNH, *, attention_masks, score_mod=None, scale=None, enable_gqa=False,
          out_transform=None, **kwargs):
    assert score_mod is None and out_transform is None
    q, k, v = (t.transpose(1, 2) for t in (q_BLNH, k_BLNH, v_BLNH))
    mask = create_mask(attention_masks.mask_mod, q.shape[0], 1, q.shape[2], k.shape[2], device=q.device)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=enable_gqa).transpose(1, 2)


_no_division = titan_fsdp.disable_fsdp_gradient_division


def _sum_only(model):
    _no_division(model)
    for m in model.modules():
        if isinstance(m, titan_fsdp.FSDPModule):
            m.set_force_sum_reduction_for_comms(True)


metrics.build_device_memory_monitor = _NoMemory
metrics.BaseLogger.log = _print_metrics
attention.FlexAttention.forward = _sdpa
titan_fsdp.disable_fsdp_gradient_division = _sum_only
titan_utils.set_pg_timeouts = lambda *args, **kwargs: None
if os.environ.get("TINY_TITAN_NORM64") == "1":
    titan_utils.clip_grad_norm_ = _clip_logging_f64

if __name__ == "__main__":
    import torchtitan.train

    sys.argv = ["torchtitan.train", *sys.argv[1:]]
    torchtitan.train.main()
