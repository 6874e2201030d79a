"""RMSNorm's arithmetic on a row's values as Triton functions (module-level, so several kernels call them): the
fused norm kernel (`norm.py`) and the GDN step kernel, which applies the GDN output gate on its way out (`gdn.py`).
Every rounding is the reference's (`engine.models.layers.rms_norm_reference`, `gated_rms_norm`)."""
import triton
import triton.language as tl


@triton.jit
def weighted(x, rstd, w, dt, ZERO_CENTRED: tl.constexpr):
    """x (fp32 holding model-dtype values) times rstd and the weight w (fp32), in the reference's order: (1 + w)
    applied in fp32 then cast (zero-centred), or cast then w (plain); model-dtype values back in fp32."""
    if ZERO_CENTRED:
        return (x * rstd * (1.0 + w)).to(dt).to(tl.float32)
    return (w * (x * rstd).to(dt).to(tl.float32)).to(dt).to(tl.float32)


@triton.jit
def silu_gated(out, z):
    """out times silu(z), in fp32."""
    return out * (z / (1.0 + tl.exp(-z)))
