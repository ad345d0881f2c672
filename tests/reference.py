"""The NumPy reference forward pass of the tests (float64), written from the paper's equations
(arXiv:2010.11929, Sec. 3.1, and vit_jax's models_vit.py) on arrays named as in the released `.npz`
checkpoints. Every test that compares numerics uses it: layers and blocks (`encoder_block`), whole models
and `.npz` checkpoints (`vit_logits`), and timm / Hugging Face state dicts (`torch_logits`, through this
file's own statement of those layouts). Independent of keras_vit: its own zoom, its own key names."""

from __future__ import annotations

import math

import keras
import numpy as np

_erf = np.vectorize(math.erf, otypes=[np.float64])


def released_names(model_or_layer) -> dict[str, np.ndarray]:
    """The weights of a keras_vit model or encoder block, float64, under the names of the
    released `.npz` files (the test's own statement of that layout, not keras_vit's converter)."""
    arrays = {}
    for weight in model_or_layer.weights:
        key = weight.path.replace("/gamma", "/scale").replace("/beta", "/bias")
        key = key.replace("/attention_output/", "/out/").replace("cls/cls", "cls")
        key = key.replace("registers/registers", "registers").replace("dist_token/registers", "dist_token")
        if key.split("/")[0].startswith(("encoderblock_", "posembed_input", "encoder_norm")):
            key = "Transformer/" + key
        arrays[key] = keras.ops.convert_to_numpy(weight).astype("float64")
    return arrays


def layer_norm(x, scale, bias, eps=1e-6):
    return (x - x.mean(-1, keepdims=True)) / np.sqrt(x.var(-1, keepdims=True) + eps) * scale + bias


def gelu_tanh(x):
    return 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x ** 3)))


def gelu_erf(x):
    return 0.5 * x * (1 + _erf(x / math.sqrt(2)))


def softmax(x):
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def quick_gelu(x):
    return x / (1 + np.exp(-1.702 * x))


def silu(x):
    return x / (1 + np.exp(-x))


def rope_tables(grid_size, head_dim: int, theta: float, num_prefix_tokens: int, form: str = "dinov3",
                reference_grid=None):
    """A 2-D rotary position embedding, float64: cos and sin of each token's angles, (prefix + rows * columns,
    head_dim), in the half layout. DINOv3's (the DINOv3 paper, Sec. 3; transformers' `DINOv3ViTRopePosition
    Embedding`): patch centres normalized to [-1, 1] per axis, (y, x), times 2 pi; EVA-02's (timm's
    `RotaryEmbeddingCat`, `in_pixels=False`): patch indices, scaled to `reference_grid` (timm's `ref_feat_shape`)
    if given. Frequencies theta ** (-4 j / head_dim), j < head_dim / 4; angles [y w, x w] twice over; the prefix
    tokens' angles 0."""
    rows, columns = grid_size
    if form == "dinov3":
        axes = [2 * np.pi * ((np.arange(size) + 0.5) / size * 2 - 1) for size in grid_size]
    else:
        axes = [np.arange(size) * (1.0 if reference_grid is None else reference_grid[i] / size)
                for i, size in enumerate(grid_size)]
    y, x = np.meshgrid(*axes, indexing="ij")
    omega = theta ** -(np.arange(head_dim // 4) * 4 / head_dim)
    angles = np.concatenate([np.outer(y.ravel(), omega), np.outer(x.ravel(), omega)], axis=1)
    angles = np.concatenate([np.zeros((num_prefix_tokens, head_dim // 2)), angles])
    angles = np.concatenate([angles, angles], axis=1)
    return np.cos(angles), np.sin(angles)


def rotate(x, cos, sin):
    """x cos + rotate_half(x) sin of (batch, tokens, heads, head_dim) x, rotate_half([a, b]) = [-b, a]."""
    half = x.shape[-1] // 2
    rotated = np.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos[:x.shape[1], None] + rotated * sin[:x.shape[1], None]


def encoder_block(a, block: str, x, attention_scale=1.0, mlp_scale=1.0, *, eps=1e-6, gelu=gelu_tanh, rotary=None):
    """x + MHA(LN(x)), then + MLP(LN(.)) (GELU in its tanh form by default), for the block named `block`
    (e.g. "Transformer/encoderblock_0"). The residual branches are multiplied by `attention_scale`
    and `mlp_scale` (0 or 1 / keep rate under drop path), and by the layer scales `ls1/scale`, `ls2/scale`
    where `a` has them; q and k are LayerNormed per head where `a` has `query_norm` / `key_norm`, then rotated by
    `rotary` ((cos, sin) of `rope_tables`) if given. Returns the output and the attention weights."""
    y = layer_norm(x, a[f"{block}/LayerNorm_0/scale"], a[f"{block}/LayerNorm_0/bias"], eps)
    attended, weights = attention(a, f"{block}/MultiHeadDotProductAttention_1", y, y, eps, rotary)
    x = x + attention_scale * a.get(f"{block}/ls1/scale", 1.0) * attended
    y = layer_norm(x, a[f"{block}/LayerNorm_2/scale"], a[f"{block}/LayerNorm_2/bias"], eps)
    return x + mlp_scale * a.get(f"{block}/ls2/scale", 1.0) * mlp(a, f"{block}/MlpBlock_3", y, gelu, eps), weights


def attention(a, m, queries, tokens, eps=1e-6, rotary=None):
    """Multi-head attention `m` of `queries` over `tokens` (q/k LayerNormed per head where `a` has
    `query_norm` / `key_norm`, then rotated by `rotary`, (cos, sin), if given): (output, attention weights)."""
    q = np.einsum("btd,dhk->bthk", queries, a[f"{m}/query/kernel"]) + a[f"{m}/query/bias"]
    k, v = (np.einsum("btd,dhk->bthk", tokens, a[f"{m}/{n}/kernel"]) + a[f"{m}/{n}/bias"] for n in ("key", "value"))
    if f"{m}/query_norm/scale" in a:
        q = layer_norm(q, a[f"{m}/query_norm/scale"], a[f"{m}/query_norm/bias"], eps)
        k = layer_norm(k, a[f"{m}/key_norm/scale"], a[f"{m}/key_norm/bias"], eps)
    if rotary is not None:
        q, k = rotate(q, *rotary), rotate(k, *rotary)
    weights = softmax(np.einsum("bqhk,bshk->bhqs", q, k) / np.sqrt(q.shape[-1]))
    attended = np.einsum("bhqs,bshk->bqhk", weights, v)
    return np.einsum("bqhk,hkd->bqd", attended, a[f"{m}/out/kernel"]) + a[f"{m}/out/bias"], weights


def mlp(a, m, x, gelu=gelu_tanh, eps=1e-6):
    """Dense_1(act(Dense_0(x))); where `a` has `Dense_gate` (SwiGLU), Dense_1(act(Dense_gate(x)) * Dense_0(x));
    where it has `norm`, the hidden layer LayerNormed before Dense_1."""
    hidden = x @ a[f"{m}/Dense_0/kernel"] + a[f"{m}/Dense_0/bias"]
    if f"{m}/Dense_gate/kernel" in a:
        hidden = gelu(x @ a[f"{m}/Dense_gate/kernel"] + a[f"{m}/Dense_gate/bias"]) * hidden
    else:
        hidden = gelu(hidden)
    if f"{m}/norm/scale" in a:  # timm's scale_mlp (EVA-02 B / L)
        hidden = layer_norm(hidden, a[f"{m}/norm/scale"], a[f"{m}/norm/bias"], eps)
    return hidden @ a[f"{m}/Dense_1/kernel"] + a[f"{m}/Dense_1/bias"]


def map_head(a, x, eps=1e-6, gelu=gelu_tanh):
    """big_vision's MAPHead (SigLIP): a learned probe attends over the tokens, then y + MLP(LN(y)), row 0."""
    probe = np.broadcast_to(a["MAPHead_0/probe"], (x.shape[0], 1, x.shape[-1]))
    y, _ = attention(a, "MAPHead_0/MultiHeadDotProductAttention_0", probe, x, eps)
    normed = layer_norm(y, a["MAPHead_0/LayerNorm_0/scale"], a["MAPHead_0/LayerNorm_0/bias"], eps)
    return (y + mlp(a, "MAPHead_0/MlpBlock_0", normed, gelu))[:, 0]


def zoom_linear(grid, new_h, new_w):
    """scipy.ndimage.zoom(grid, (new_h/h, new_w/w, 1), order=1), point by point."""
    h, w, _ = grid.shape
    out = np.zeros((new_h, new_w, grid.shape[2]))
    for i in range(new_h):
        y = i * (h - 1) / (new_h - 1) if new_h > 1 else 0.0
        y0 = min(int(y), h - 1)
        y1, fy = min(y0 + 1, h - 1), y - y0
        for j in range(new_w):
            x = j * (w - 1) / (new_w - 1) if new_w > 1 else 0.0
            x0 = min(int(x), w - 1)
            x1, fx = min(x0 + 1, w - 1), x - x0
            out[i, j] = ((1 - fy) * (1 - fx) * grid[y0, x0] + (1 - fy) * fx * grid[y0, x1]
                         + fy * (1 - fx) * grid[y1, x0] + fy * fx * grid[y1, x1])
    return out


def _same_pads(size, kernel, stride):
    total = max((-(-size // stride) - 1) * stride + kernel - size, 0)
    return total // 2, total - total // 2


def conv(x, kernel, stride, padding):
    kh, kw, _, out_channels = kernel.shape
    if padding == "SAME":
        pads = (_same_pads(x.shape[1], kh, stride), _same_pads(x.shape[2], kw, stride))
        x = np.pad(x, ((0, 0), pads[0], pads[1], (0, 0)))
    oh, ow = (x.shape[1] - kh) // stride + 1, (x.shape[2] - kw) // stride + 1
    out = np.zeros((x.shape[0], oh, ow, out_channels))
    for i in range(kh):
        for j in range(kw):
            out += x[:, i:i + stride * oh:stride, j:j + stride * ow:stride, :] @ kernel[i, j]
    return out


def _std_conv(x, kernel, stride):
    mean = kernel.mean(axis=(0, 1, 2), keepdims=True)
    std = kernel.std(axis=(0, 1, 2), keepdims=True)  # population std
    return conv(x, (kernel - mean) / (std + 1e-5), stride, "SAME")


def _group_norm(x, scale, bias, groups=32):
    b, h, w, c = x.shape
    g = x.reshape(b, h, w, groups, c // groups)
    g = (g - g.mean(axis=(1, 2, 4), keepdims=True)) / np.sqrt(g.var(axis=(1, 2, 4), keepdims=True) + 1e-6)
    return g.reshape(b, h, w, c) * scale.reshape(-1) + bias.reshape(-1)


def _max_pool_same(x):
    pads = (_same_pads(x.shape[1], 3, 2), _same_pads(x.shape[2], 3, 2))
    x = np.pad(x, ((0, 0), pads[0], pads[1], (0, 0)), constant_values=-np.inf)
    oh, ow = (x.shape[1] - 3) // 2 + 1, (x.shape[2] - 3) // 2 + 1
    return np.max([x[:, i:i + 2 * oh:2, j:j + 2 * ow:2] for i in range(3) for j in range(3)], axis=0)


def _resnet(a, x, stages):
    x = np.maximum(_group_norm(_std_conv(x, a["conv_root/kernel"], 2), a["gn_root/scale"], a["gn_root/bias"]), 0)
    x = _max_pool_same(x)
    for s, units in enumerate(stages, start=1):
        for u in range(1, units + 1):
            p, stride = f"block{s}/unit{u}", 2 if s > 1 and u == 1 else 1

            def gn(y, name):
                return _group_norm(y, a[f"{p}/{name}/scale"], a[f"{p}/{name}/bias"])

            y = np.maximum(gn(_std_conv(x, a[f"{p}/conv1/kernel"], 1), "gn1"), 0)
            y = np.maximum(gn(_std_conv(y, a[f"{p}/conv2/kernel"], stride), "gn2"), 0)
            y = gn(_std_conv(y, a[f"{p}/conv3/kernel"], 1), "gn3")
            residual = gn(_std_conv(x, a[f"{p}/conv_proj/kernel"], stride), "gn_proj") if u == 1 else x
            x = np.maximum(residual + y, 0)
    return x


def vit_logits(arrays, images, resnet_stages=None, posemb_grid=None, *, eps=1e-6, gelu=gelu_tanh, pixels=True,
               no_embed_class=False, block_outputs=None, rope_theta=None, rope_form="dinov3",
               rope_reference_grid=None):
    """Logits of the released-layout checkpoint `arrays` on `images` at the images' resolution: pixels in
    [0, 255] mapped to [-1, 1] as the models' preprocessing does, or, with `pixels=False`, images already in
    [-1, 1]. `posemb_grid`: the (rows, columns) its position embedding was trained at, square by default;
    another grid at the images' resolution is resampled with `zoom_linear`. Without a head, the pooled
    features (through `pre_logits` if present).

    The ViT family's options, where `arrays` has their weights (timm's semantics): register tokens
    (`registers`, after the class token, no position), `norm_pre/scale`, `fc_norm/scale` (no final
    norm; the average of the patch tokens, then this norm), layer scale and q/k norms (`encoder_block`),
    no patch-embedding bias (CLIP), attention pooling (`MAPHead_0/...`: `map_head`);
    `no_embed_class`: the position embedding covers only the patches, the class token is prepended after.
    `block_outputs`: a list that receives each encoder block's output tokens. `rope_theta`: q and k rotated by
    rotary angles (`rope_tables` of `rope_form` and `rope_reference_grid`) of this base period; the position table
    is added where `arrays` has one (EVA-02), not otherwise (DINOv3)."""
    a = {key: np.asarray(value, np.float64) for key, value in arrays.items()}
    x = images.astype(np.float64) / 127.5 - 1 if pixels else images.astype(np.float64)
    if resnet_stages:
        x = _resnet(a, x, resnet_stages)
    patch = a["embedding/kernel"].shape[0]
    x = conv(x, a["embedding/kernel"], patch, "VALID") + a.get("embedding/bias", 0.0)  # CLIP has no bias
    gh, gw = x.shape[1:3]
    x = x.reshape(x.shape[0], gh * gw, -1)
    prefix = (1 if "cls" in a else 0) + ("dist_token" in a)
    embedded = 0 if no_embed_class else prefix

    def prepend(tokens, x):
        return np.concatenate([np.broadcast_to(tokens, (x.shape[0], *tokens.shape[1:])), x], axis=1)

    if "dist_token" in a:  # DeiT distilled: [class, distillation, patches]
        x = prepend(a["dist_token"], x)
    if embedded:
        x = prepend(a["cls"], x)
    if "Transformer/posembed_input/pos_embedding" in a:
        posemb = a["Transformer/posembed_input/pos_embedding"][0]
        old = posemb_grid or (int(np.sqrt(len(posemb) - embedded)),) * 2
        if tuple(old) != (gh, gw):
            grid = zoom_linear(posemb[embedded:].reshape(*old, -1), gh, gw).reshape(gh * gw, -1)
            posemb = np.concatenate([posemb[:embedded], grid])
        x = x + posemb
    registers = a.get("registers")
    if registers is not None:
        x = np.concatenate([x[:, :embedded], prepend(registers, x[:, embedded:])], axis=1)
    if prefix and not embedded:
        x = prepend(a["cls"], x)
    if "norm_pre/scale" in a:
        x = layer_norm(x, a["norm_pre/scale"], a["norm_pre/bias"], eps)
    num_blocks = len({key.split("/")[1] for key in a if key.startswith("Transformer/encoderblock_")})
    rotary = None
    if rope_theta is not None:
        head_dim = a["Transformer/encoderblock_0/MultiHeadDotProductAttention_1/query/kernel"].shape[-1]
        rotary = rope_tables((gh, gw), head_dim, rope_theta, x.shape[1] - gh * gw, rope_form, rope_reference_grid)
    for i in range(num_blocks):
        x, _ = encoder_block(a, f"Transformer/encoderblock_{i}", x, eps=eps, gelu=gelu, rotary=rotary)
        if block_outputs is not None:
            block_outputs.append(x)
    if "fc_norm/scale" in a:
        patches = x[:, prefix + (0 if registers is None else registers.shape[1]):]
        x = layer_norm(patches.mean(axis=1), a["fc_norm/scale"], a["fc_norm/bias"], eps)
    else:
        x = layer_norm(x, a["Transformer/encoder_norm/scale"], a["Transformer/encoder_norm/bias"], eps)
        if "head_dist/kernel" in a:  # DeiT's inference: the mean of its two heads
            return (x[:, 0] @ a["head/kernel"] + a["head/bias"] + x[:, 1] @ a["head_dist/kernel"]
                    + a["head_dist/bias"]) / 2
        if "MAPHead_0/probe" in a:  # attention pooling over every token (SigLIP: there is no class token)
            x = map_head(a, x, eps, gelu)
        elif prefix and "head/kernel" in a and a["head/kernel"].shape[0] == 2 * x.shape[-1]:
            patches = x[:, prefix + (0 if registers is None else registers.shape[1]):]  # DINOv2's classifiers
            x = np.concatenate([x[:, 0], patches.mean(axis=1)], axis=-1)
        else:
            x = x[:, 0] if prefix else x[:, 0 if registers is None else registers.shape[1]:].mean(axis=1)
    if "pre_logits/kernel" in a:
        x = np.tanh(x @ a["pre_logits/kernel"] + a["pre_logits/bias"])
    return x @ a["head/kernel"] + a["head/bias"] if "head/kernel" in a else x


# --- The PyTorch world's layouts, stated here (not by keras_vit's translator), on the same reference ---

# Numerics of the source models: exact (erf) GELU; LayerNorm epsilon 1e-6 (timm), 1e-12 (Hugging Face).
TORCH_EPS = {"timm": 1e-6, "huggingface": 1e-12}


def _torch_block_names(timm: bool) -> dict[str, str]:
    if timm:
        return dict(ln0="norm1", ln2="norm2", out="attn.proj", fc1="mlp.fc1", fc2="mlp.fc2")
    return dict(ln0="layernorm_before", ln2="layernorm_after", out="attention.output.dense",
                fc1="intermediate.dense", fc2="output.dense")


def released_from_torch(state: dict, num_heads: int) -> dict[str, np.ndarray]:
    """A timm `VisionTransformer` or Hugging Face `ViT[ForImageClassification|Model]` state dict under the
    released names and shapes: Linear (out, in) transposed, Conv2d (out, in, kh, kw) to (kh, kw, in, out),
    query/key/value (fused in timm) split into `num_heads` heads, the HF pooler as `pre_logits`."""
    t = {key.removeprefix("vit."): np.asarray(value, np.float64) for key, value in state.items()}
    timm = "patch_embed.proj.weight" in t
    embed = "patch_embed.proj" if timm else "embeddings.patch_embeddings.projection"
    norm = "norm" if timm else "layernorm"
    a = {"embedding/kernel": t[embed + ".weight"].transpose(2, 3, 1, 0),
         "Transformer/posembed_input/pos_embedding": t["pos_embed" if timm else "embeddings.position_embeddings"]}
    for source, released in ((embed + ".bias", "embedding/bias"),  # CLIP's has none
                             ("cls_token" if timm else "embeddings.cls_token", "cls")):  # SigLIP has none
        if source in t:
            a[released] = t[source]
    if "attn_pool.latent" in t:  # timm's attention pooling (global_pool='map'), as big_vision's MAPHead
        m, width = "MAPHead_0/MultiHeadDotProductAttention_0", t["attn_pool.latent"].shape[-1]
        a["MAPHead_0/probe"] = t["attn_pool.latent"]
        key, value = np.split(t["attn_pool.kv.weight"], 2)
        key_bias, value_bias = np.split(t["attn_pool.kv.bias"], 2)
        for name, weight, bias in (("query", t["attn_pool.q.weight"], t["attn_pool.q.bias"]),
                                   ("key", key, key_bias), ("value", value, value_bias)):
            a[f"{m}/{name}/kernel"] = weight.T.reshape(width, num_heads, -1)
            a[f"{m}/{name}/bias"] = bias.reshape(num_heads, -1)
        a[f"{m}/out/kernel"] = t["attn_pool.proj.weight"].T.reshape(num_heads, -1, width)
        a[f"{m}/out/bias"] = t["attn_pool.proj.bias"]
        a["MAPHead_0/LayerNorm_0/scale"], a["MAPHead_0/LayerNorm_0/bias"] = t["attn_pool.norm.weight"], \
            t["attn_pool.norm.bias"]
        for fc, dense in (("fc1", "Dense_0"), ("fc2", "Dense_1")):
            a[f"MAPHead_0/MlpBlock_0/{dense}/kernel"] = t[f"attn_pool.mlp.{fc}.weight"].T
            a[f"MAPHead_0/MlpBlock_0/{dense}/bias"] = t[f"attn_pool.mlp.{fc}.bias"]
    renamed = {norm: "Transformer/encoder_norm", "norm_pre": "norm_pre", "fc_norm": "fc_norm"}
    for source, released in renamed.items():  # timm's family options: norm_pre (CLIP), fc_norm without `norm`
        if source + ".weight" in t:
            a[released + "/scale"], a[released + "/bias"] = t[source + ".weight"], t[source + ".bias"]
    if "reg_token" in t:
        a["registers"] = t["reg_token"]
    if "dist_token" in t:
        a["dist_token"] = t["dist_token"]
        a["head_dist/kernel"], a["head_dist/bias"] = t["head_dist.weight"].T, t["head_dist.bias"]
    for top, released in (("head" if timm else "classifier", "head"), ("pooler.dense", "pre_logits")):
        if top + ".weight" in t:
            a[released + "/kernel"], a[released + "/bias"] = t[top + ".weight"].T, t[top + ".bias"]
    names, blocks, i = _torch_block_names(timm), "blocks" if timm else "encoder.layer", 0
    while f"{blocks}.{i}.{names['ln0']}.weight" in t:
        b, r = f"{blocks}.{i}.", f"Transformer/encoderblock_{i}"
        for name, released in (("ln0", "LayerNorm_0"), ("ln2", "LayerNorm_2")):
            a[f"{r}/{released}/scale"] = t[f"{b}{names[name]}.weight"]
            a[f"{r}/{released}/bias"] = t[f"{b}{names[name]}.bias"]
        for name, released in (("fc1", "Dense_0"), ("fc2", "Dense_1")):
            a[f"{r}/MlpBlock_3/{released}/kernel"] = t[f"{b}{names[name]}.weight"].T
            a[f"{r}/MlpBlock_3/{released}/bias"] = t[f"{b}{names[name]}.bias"]
        if timm:
            qkv = zip(np.split(t[b + "attn.qkv.weight"], 3), np.split(t[b + "attn.qkv.bias"], 3))
        else:
            qkv = [(t[f"{b}attention.attention.{n}.weight"], t[f"{b}attention.attention.{n}.bias"])
                   for n in ("query", "key", "value")]
        m = f"{r}/MultiHeadDotProductAttention_1"
        for name, (weight, bias) in zip(("query", "key", "value"), qkv):
            a[f"{m}/{name}/kernel"] = weight.T.reshape(weight.shape[1], num_heads, -1)
            a[f"{m}/{name}/bias"] = bias.reshape(num_heads, -1)
        out = t[f"{b}{names['out']}.weight"]
        a[f"{m}/out/kernel"] = out.T.reshape(num_heads, -1, out.shape[0])
        a[f"{m}/out/bias"] = t[f"{b}{names['out']}.bias"]
        for source, released in (("ls1.gamma", f"{r}/ls1/scale"), ("ls2.gamma", f"{r}/ls2/scale"),
                                 ("attn.q_norm.weight", f"{m}/query_norm/scale"),
                                 ("attn.q_norm.bias", f"{m}/query_norm/bias"),
                                 ("attn.k_norm.weight", f"{m}/key_norm/scale"),
                                 ("attn.k_norm.bias", f"{m}/key_norm/bias")):
            if b + source in t:
                a[released] = t[b + source]
        i += 1
    return a


def torch_logits(state: dict, images, num_heads: int, no_embed_class: bool = False, eps: float | None = None,
                 gelu=gelu_erf) -> np.ndarray:
    """The source model's output on NHWC `images` in [-1, 1]: `vit_logits` of `released_from_torch(state)`
    with its numerics (exact GELU and its layout's epsilon unless given: a timm CLIP has 1e-5 and QuickGELU).
    Logits; without a head, the pooler output or the class token after the norm. `no_embed_class`: timm's
    option of that name (the file's `pos_embed` has no class row)."""
    eps = eps or TORCH_EPS["timm" if "patch_embed.proj.weight" in state else "huggingface"]
    return vit_logits(released_from_torch(state, num_heads), np.asarray(images), eps=eps, gelu=gelu, pixels=False,
                      no_embed_class=no_embed_class)


def rollout(attentions) -> np.ndarray:
    """Attention rollout (Abnar & Zuidema 2020) in float64: per layer, the mean over heads (batch, heads, T, T) plus
    the identity (the residual), rows renormalized; the layers multiplied, first layer rightmost. (batch, T, T)."""
    joint = None
    for attention in attentions:
        mixed = np.asarray(attention, np.float64).mean(axis=1) + np.eye(np.shape(attention)[-1])
        mixed /= mixed.sum(axis=-1, keepdims=True)
        joint = mixed if joint is None else mixed @ joint
    return joint


def rollout_map(joint: np.ndarray, grid_size, num_prefix_tokens: int, class_token: bool) -> np.ndarray:
    """(batch, rows, columns): the class token's row of `rollout` over the patches, else the mean of all rows."""
    patches = joint[:, :, num_prefix_tokens:]
    flows = patches[:, 0] if class_token else patches.mean(axis=1)
    return flows.reshape(-1, *grid_size)


def sincos_2d(grid_size, width, temperature=10_000.0):
    """big_vision's fixed 2-D sine-cosine table (`posemb_sincos_2d`) of a (rows, columns) grid, (rows * columns,
    width), float64: [sin(x w), cos(x w), sin(y w), cos(y w)], w_d = temperature ** -(d / (width / 4 - 1))."""
    y, x = np.mgrid[: grid_size[0], : grid_size[1]]
    omega = 1.0 / temperature ** (np.arange(width // 4) / max(width // 4 - 1, 1))
    y, x = np.outer(y.ravel(), omega), np.outer(x.ravel(), omega)
    return np.concatenate([np.sin(x), np.cos(x), np.sin(y), np.cos(y)], axis=1)
