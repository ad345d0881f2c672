"""The encoder layers of ViT: pre-norm Transformer blocks (paper Eq. 2-3) and what they are made of (LayerNorm,
multi-head attention, the GELU MLP, layer scale, drop path), and the attention-pooling head built from them.
Sublayers carry the names of the released checkpoints (`LayerNorm_0`, `MultiHeadDotProductAttention_1`,
`LayerNorm_2`, `MlpBlock_3/Dense_0`, ...). The maths is here; `keras_vit.kernels` chooses how it runs."""

from __future__ import annotations

import math

import keras
from keras import ops

from keras_vit import kernels
from keras_vit.kernels.routed_layers import Dense, HeadProjection, LayerNorm
from keras_vit.layers.tokens import apply_rotary
from keras_vit.variants import ACTIVATIONS, ViTConfig

LAYER_NORM_EPSILON = ViTConfig.layer_norm_epsilon  # the original's

_register = keras.saving.register_keras_serializable(package="keras_vit")


@_register
class LayerScale(keras.layers.Layer):
    """x * gamma: a learned per-channel scale of a residual branch (CaiT; DeiT-III, DINOv2), weight `gamma`.

    Args:
        init_value: float. Initial value of every channel's scale. Defaults to `1e-5`.
    """

    def __init__(self, init_value: float = 1e-5, **kwargs):
        super().__init__(**kwargs)
        self.init_value = init_value

    def build(self, input_shape):
        self.gamma = self.add_weight(name="gamma", shape=(input_shape[-1],),
                                     initializer=keras.initializers.Constant(self.init_value))

    def call(self, x):
        return x * ops.cast(self.gamma, x.dtype)

    def compute_output_shape(self, input_shape):
        return input_shape

    def get_config(self):
        config = super().get_config()
        config.update({"init_value": self.init_value})
        return config


@_register
class StochasticDepth(keras.layers.Layer):
    """Drops a whole residual branch per example with probability `rate` during training.

    Kept examples are scaled by 1 / (1 - rate) (Huang et al. 2016, "drop path").

    Args:
        rate: float in [0, 1). Drop probability.
        seed: optional int seed.
    """

    def __init__(self, rate: float, seed: int | None = None, **kwargs):
        super().__init__(**kwargs)
        if not 0.0 <= rate < 1.0:
            raise ValueError(f"`rate` must be in [0, 1). Received: rate={rate}")
        self.rate = rate
        self.seed = seed
        # Only when it can drop, as keras.layers.Dropout: no non-trainable state where nothing is random.
        self.seed_generator = keras.random.SeedGenerator(seed) if rate > 0 else None

    def call(self, x, training=None):
        if not training or self.rate == 0.0:
            return x
        keep = 1.0 - self.rate
        shape = (ops.shape(x)[0],) + (1,) * (len(x.shape) - 1)
        mask = keras.random.uniform(shape, seed=self.seed_generator, dtype=x.dtype) < keep
        return x * ops.cast(mask, x.dtype) / ops.cast(keep, x.dtype)

    def compute_output_shape(self, input_shape):
        return input_shape

    def get_config(self):
        config = super().get_config()
        config.update({"rate": self.rate, "seed": self.seed})
        return config


@_register
class MultiHeadDotProductAttention(keras.layers.Layer):
    """Multi-head self-attention of ViT, with the original's weights (paper App. A, Eq. 5-8).

        q, k, v = x W_q, x W_k, x W_v                  (batch, tokens, heads, head_dim)
        q, k = LN(q), LN(k)                            with `qk_norm`
        q, k = q cos + rotate_half(q) sin, the same for k    given `rotary` (RoPE: `RotaryPositionEmbedding`)
        A = softmax(q k^T / sqrt(head_dim))            (batch, heads, tokens, tokens); the logits of keys
                                                       `attention_mask` leaves out set to -1e9 first
        out = (A v) W_o                                (batch, tokens, D)

    The projections are the sublayers `query`, `key`, `value` (kernels (D, heads, head_dim), biases
    (heads, head_dim)) and `attention_output` ((heads, head_dim, D), (D,)): the checkpoints' shapes and
    those of `keras.layers.MultiHeadAttention`, whose weight files load here unchanged.

    Where it pays (`kernels.attention_kernel`, chosen once when the layer is built: JAX and PyTorch on GPUs
    and TPUs, PyTorch inference on CPUs) and A is neither returned nor dropped out, (A v) is one fused op
    (`keras.ops.dot_product_attention`); in a SavedModel for Eigen servers it is computed head by head
    (`kernels.fused_attention`).

    Args:
        num_heads: int. Attention heads; the hidden size must be divisible by it.
        dropout_rate: float. Dropout on the attention weights in training. Defaults to `0.0`.
        kernel_initializer: initializer of the four kernels. Defaults to `"glorot_uniform"`.
        qk_norm: bool. LayerNorm each head's q and k (over head_dim; sublayers `query_norm`, `key_norm`)
            before the logits, as timm's `qk_norm`. Defaults to `False`.
        layer_norm_epsilon: float. Epsilon of those norms. Defaults to `1e-6`.

    Call arguments:
        x: (batch, tokens, hidden_dim).
        context: optional (batch, context_tokens, hidden_dim): the keys and values come from it instead of x
            (cross-attention: the probe of `MAPHead`).
        rotary: optional (cos, sin) of `RotaryPositionEmbedding`, each (tokens, head_dim): q and k are rotated by
            them (x's rows take their first rows: x may be the first rows of `context`).
        training: bool. Attention dropout on when True.
        return_attention_scores: bool. Also return the attention weights A, (batch, heads,
            tokens, context_tokens).
        attention_mask: optional (batch, context_tokens), 1 (or True) for the keys to attend to, 0 for padding
            (NaFlex's patch sequences): those keys get weight 0, as transformers' -inf-like additive mask gives them.
    """

    def __init__(self, num_heads: int, dropout_rate: float = 0.0, kernel_initializer="glorot_uniform",
                 qk_norm: bool = False, layer_norm_epsilon: float = LAYER_NORM_EPSILON, **kwargs):
        super().__init__(**kwargs)
        self.num_heads = num_heads
        self.dropout_rate = dropout_rate
        self.kernel_initializer = keras.initializers.get(kernel_initializer)
        self.qk_norm = qk_norm
        self.layer_norm_epsilon = layer_norm_epsilon

    def build(self, input_shape):
        width = input_shape[-1]
        if width % self.num_heads:
            raise ValueError(f"Hidden size {width} is not divisible by num_heads={self.num_heads}.")
        heads, head_dim = self.num_heads, width // self.num_heads
        # Attribute names are those of keras.layers.MultiHeadAttention: `.weights.h5` files key on them.
        self.query_dense, self.key_dense, self.value_dense = (
            HeadProjection("btd,dnh->btnh", (None, heads, head_dim), bias_axes="nh", name=name,
                           kernel_initializer=self._new_kernel_initializer(), dtype=self.dtype_policy)
            for name in ("query", "key", "value"))
        self.output_dense = HeadProjection("btnh,nhd->btd", (None, width), bias_axes="d", name="attention_output",
                                           kernel_initializer=self._new_kernel_initializer(), dtype=self.dtype_policy)
        for sublayer in (self.query_dense, self.key_dense, self.value_dense):
            sublayer.build(input_shape)
        self.output_dense.build((*input_shape[:-1], heads, head_dim))
        self.dropout = keras.layers.Dropout(self.dropout_rate, dtype=self.dtype_policy)
        self.dropout.build((input_shape[0], heads, input_shape[1], input_shape[1]))
        self.query_norm, self.key_norm = (
            LayerNorm(epsilon=self.layer_norm_epsilon, name=name, dtype=self.dtype_policy) if self.qk_norm
            else keras.layers.Identity(name=name, dtype=self.dtype_policy) for name in ("query_norm", "key_norm"))
        for norm in (self.query_norm, self.key_norm):
            norm.build((*input_shape[:-1], heads, head_dim))
        self.attention_kernel = kernels.attention_kernel()

    def _new_kernel_initializer(self):
        """A copy of the kernel initializer per projection: an unseeded Keras initializer instance draws the
        same values at every call, which would start the query, key and value kernels equal."""
        return self.kernel_initializer.__class__.from_config(self.kernel_initializer.get_config())

    def call(self, x, context=None, rotary=None, training=None, return_attention_scores=False, attention_mask=None):
        query, key, value = self._project_qkv(x) if context is None else (
            self.query_dense(x), self.key_dense(context), self.value_dense(context))  # (batch, tokens, heads, hd)
        query, key = self.query_norm(query), self.key_norm(key)
        if rotary is not None:
            query, key = apply_rotary(query, *rotary), apply_rotary(key, *rotary)
        scale = 1.0 / math.sqrt(x.shape[-1] // self.num_heads)
        dropout_active = training and self.dropout_rate > 0
        if (attention_mask is None and not return_attention_scores and not dropout_active
                and self.attention_kernel.fused(training)):
            attended = kernels.fused_attention(query, key, value, scale)  # as below
        else:
            query, key, value = (ops.transpose(t, (0, 2, 1, 3)) for t in (query, key, value))  # (batch, heads, ...)
            logits = kernels.batch_matmul(query * ops.cast(scale, query.dtype), key, transpose_b=True)
            if attention_mask is not None:
                keep = ops.cast(attention_mask, "bool")[:, None, None, :]
                logits = ops.where(keep, logits, ops.cast(-1e9, logits.dtype))
            scores = ops.softmax(logits, axis=-1)  # in the compute dtype, as the original
            attended = ops.transpose(kernels.batch_matmul(self.dropout(scores, training=training), value),
                                     (0, 2, 1, 3))
        out = self.output_dense(attended)
        return (out, scores) if return_attention_scores else out

    def _project_qkv(self, x):
        """x W_q, x W_k, x W_v, each (batch, tokens, heads, head_dim), LoRA kernels merged (`kernels.projections`
        chooses one matmul or three). Quantized projections each take Keras' quantized call instead."""
        projections = (self.query_dense, self.key_dense, self.value_dense)
        if any(projection.quantization_mode for projection in projections):
            return [projection(x) for projection in projections]
        width, heads = x.shape[-1], self.num_heads
        outputs = kernels.projections(ops.reshape(x, (-1, width)),
                                      [ops.reshape(p.kernel, (width, width)) for p in projections],
                                      [ops.reshape(p.bias, (width,)) for p in projections])
        shape = (ops.shape(x)[0], ops.shape(x)[1], heads, width // heads)
        return [ops.reshape(output, shape) for output in outputs]

    def compute_output_shape(self, input_shape):
        return input_shape

    def compute_output_spec(self, x, context=None, rotary=None, training=None, return_attention_scores=False,
                            attention_mask=None):
        output = keras.KerasTensor(x.shape, dtype=self.compute_dtype)
        if not return_attention_scores:
            return output
        keys = x.shape[1] if context is None else context.shape[1]
        return output, keras.KerasTensor((x.shape[0], self.num_heads, x.shape[1], keys), dtype=self.compute_dtype)

    def get_config(self):
        config = super().get_config()
        config.update({"num_heads": self.num_heads, "dropout_rate": self.dropout_rate,
                       "kernel_initializer": keras.initializers.serialize(self.kernel_initializer),
                       "qk_norm": self.qk_norm, "layer_norm_epsilon": self.layer_norm_epsilon})
        return config


@_register
class MlpBlock(keras.layers.Layer):
    """The encoder's MLP: Dense(mlp_dim) -> GELU -> Dropout -> Dense(D) -> Dropout,

        MLP(x) = Dense_1(act(Dense_0(x)))                         or, `gated`,
        MLP(x) = Dense_1(act(Dense_gate(x)) * Dense_0(x))         (SwiGLU with act = SiLU: DINOv3 H+ / 7B, EVA-02)

    and with `norm`, Dense_1 reads LN(h) of the hidden layer h (timm's `scale_mlp`: EVA-02 B / L).

    Args:
        mlp_dim: int. Hidden width.
        dropout_rate: float. Dropout after the GELU and after the second Dense. Defaults to `0.0`.
        gelu_approximate: bool. `True`: tanh-approximate GELU (the original's Flax `nn.gelu`);
            `False`: exact erf GELU (PyTorch's `nn.GELU()`, timm and Hugging Face). Defaults to `True`.
        activation: `"gelu"` (as `gelu_approximate` says), `"quick_gelu"`, x * sigmoid(1.702 x) (OpenAI
            CLIP), or `"silu"`, x * sigmoid(x). Defaults to `"gelu"`.
        gated: bool. The gated form above, with a third Dense `Dense_gate` (mlp_dim wide). Defaults to `False`.
        norm: bool. The LayerNorm `norm` on the hidden layer. Defaults to `False`.
        layer_norm_epsilon: float. Its epsilon. Defaults to `1e-6`.

    Call arguments:
        x: (..., D).
        training: bool. Dropout on when True.
    """

    def __init__(self, mlp_dim: int, dropout_rate: float = 0.0, gelu_approximate: bool = True,
                 activation: str = "gelu", gated: bool = False, norm: bool = False,
                 layer_norm_epsilon: float = LAYER_NORM_EPSILON, **kwargs):
        super().__init__(**kwargs)
        if activation not in ACTIVATIONS:
            raise ValueError(f"Unknown activation {activation!r}. Expected one of {ACTIVATIONS}.")
        self.mlp_dim = mlp_dim
        self.dropout_rate = dropout_rate
        self.gelu_approximate = gelu_approximate
        self.activation = activation
        self.gated = gated
        self.norm = norm
        self.layer_norm_epsilon = layer_norm_epsilon

    def build(self, input_shape):
        width = input_shape[-1]
        dense = dict(kernel_initializer="glorot_uniform",
                     bias_initializer=keras.initializers.RandomNormal(stddev=1e-6), dtype=self.dtype_policy)
        self.dense_0 = Dense(self.mlp_dim, name="Dense_0", **dense)  # checkpoint names Dense_0, Dense_1
        self.dense_1 = Dense(width, name="Dense_1", **dense)
        self.dense_gate = Dense(self.mlp_dim, name="Dense_gate", **dense) if self.gated else None
        self.dropout = keras.layers.Dropout(self.dropout_rate, dtype=self.dtype_policy)
        self.dense_0.build(input_shape)
        self.dense_1.build((*input_shape[:-1], self.mlp_dim))
        self.dropout.build((*input_shape[:-1], self.mlp_dim))
        if self.gated:
            self.dense_gate.build(input_shape)
        self.hidden_norm = None
        if self.norm:
            self.hidden_norm = LayerNorm(epsilon=self.layer_norm_epsilon, name="norm", dtype=self.dtype_policy)
            self.hidden_norm.build((*input_shape[:-1], self.mlp_dim))

    def call(self, x, training=None):
        rows = ops.reshape(x, (-1, x.shape[-1]))  # (tokens, D): TensorFlow fuses MatMul + BiasAdd + GELU in 2-D
        if self.gated:
            h = self._activation(self.dense_gate(rows)) * self.dense_0(rows)
        else:
            h = self._activation(self.dense_0(rows))
        h = self.dropout(h, training=training)
        if self.hidden_norm is not None:
            h = self.hidden_norm(h)
        return ops.reshape(self.dropout(self.dense_1(h), training=training), ops.shape(x))

    def _activation(self, h):
        if self.activation == "quick_gelu":
            return h * ops.sigmoid(ops.cast(1.702, h.dtype) * h)
        if self.activation == "silu":
            return h * ops.sigmoid(h)
        return kernels.gelu(h, self.gelu_approximate)

    def compute_output_shape(self, input_shape):
        return input_shape

    def get_config(self):
        config = super().get_config()
        config.update({"mlp_dim": self.mlp_dim, "dropout_rate": self.dropout_rate,
                       "gelu_approximate": self.gelu_approximate, "activation": self.activation,
                       "gated": self.gated, "norm": self.norm, "layer_norm_epsilon": self.layer_norm_epsilon})
        return config


@_register
class TransformerBlock(keras.layers.Layer):
    """Pre-norm Transformer encoder block of ViT (paper Eq. 2-3):

        y = x + DropPath(LS1(Dropout(MHA(LN(x)))))
        out = y + DropPath(LS2(MLP(LN(y))))

    LS1, LS2 are the identity unless `layer_scale_init` is set (then x * gamma, per channel).

    Sublayers carry the original checkpoint names: `LayerNorm_0`, `MultiHeadDotProductAttention_1`,
    `LayerNorm_2`, `MlpBlock_3`. Dropout and drop path act in training only. On CPUs where it pays,
    float32 inference runs this same `call` XLA-compiled (`keras_vit.kernels.compiled_inference`).

    Args:
        num_heads: int. Attention heads; the hidden size must be divisible by it.
        mlp_dim: int. MLP hidden width.
        dropout_rate: float. Dropout after attention and inside the MLP. Defaults to `0.0`.
        attention_dropout_rate: float. Dropout on the attention weights. Defaults to `0.0`.
        drop_path_rate: float. Stochastic-depth rate of both residual branches. Defaults to `0.0`.
        layer_norm_epsilon: float. Defaults to `1e-6`, as the original.
        gelu_approximate: bool. The MLP's GELU: tanh approximation (`True`, the original's) or
            exact erf (`False`, PyTorch's). Defaults to `True`.
        activation: the MLP's `"gelu"`, `"quick_gelu"` or `"silu"` (`MlpBlock`). Defaults to `"gelu"`.
        gated_mlp: bool. The MLP's gated (SwiGLU) form (`MlpBlock`'s `gated`). Defaults to `False`.
        mlp_norm: bool. A LayerNorm on the MLP's hidden layer (`MlpBlock`'s `norm`). Defaults to `False`.
        layer_scale_init: optional float. Scale each residual branch by a learned per-channel `gamma`
            (sublayers `ls1`, `ls2`: DeiT-III, DINOv2) starting at this value. Defaults to `None`: no scale.
        qk_norm: bool. LayerNorm the attention's q and k per head. Defaults to `False`.
        remat: bool. Rematerialize the block in training (`kernels.rematerialized`: the backend's gradient
            checkpointing): its activations are recomputed in the backward pass instead of kept, for the
            memory of the large variants; same gradients. Needs the three rates at 0. Defaults to `False`.

    Call arguments:
        x: (batch, tokens, hidden_dim).
        training: bool, dropout and drop path on when True.
        return_attention_scores: bool. Also return the attention weights,
            (batch, heads, tokens, tokens).
        output_tokens: optional int n. Compute the outputs of the first n tokens only, (batch, n,
            hidden_dim): their rows of the same block, whose attention still reads every token. For a
            last block whose other rows nothing reads (a class-token head: `keras_vit.head_rows_model`).
            Defaults to `None`: every token.
        rotary: optional (cos, sin) of `RotaryPositionEmbedding` (RoPE models): the attention rotates q and k
            by them. Defaults to `None`.
        attention_mask: optional (batch, tokens), 0 at padding tokens no token attends to (NaFlex). Defaults to
            `None`: every token.
    """

    def __init__(self, num_heads: int, mlp_dim: int, dropout_rate: float = 0.0,
                 attention_dropout_rate: float = 0.0, drop_path_rate: float = 0.0,
                 layer_norm_epsilon: float = LAYER_NORM_EPSILON, gelu_approximate: bool = True,
                 activation: str = "gelu", layer_scale_init: float | None = None, qk_norm: bool = False,
                 remat: bool = False, gated_mlp: bool = False, mlp_norm: bool = False, **kwargs):
        super().__init__(**kwargs)
        if remat and (dropout_rate or attention_dropout_rate or drop_path_rate):
            raise ValueError(f"remat=True needs a block without random masks (the backward pass would recompute "
                             f"new ones). Received: dropout_rate={dropout_rate}, attention_dropout_rate="
                             f"{attention_dropout_rate}, drop_path_rate={drop_path_rate}; expected 0.")
        self.remat = remat
        self.num_heads = num_heads
        self.mlp_dim = mlp_dim
        self.dropout_rate = dropout_rate
        self.attention_dropout_rate = attention_dropout_rate
        self.drop_path_rate = drop_path_rate
        self.layer_norm_epsilon = layer_norm_epsilon
        self.gelu_approximate = gelu_approximate
        self.activation = activation
        self.layer_scale_init = layer_scale_init
        self.qk_norm = qk_norm
        self.gated_mlp = gated_mlp
        self.mlp_norm = mlp_norm

    def build(self, input_shape):
        policy = self.dtype_policy  # the attention layer's build checks that num_heads divides the width
        kernels.warn_if_bfloat16_is_emulated(self.compute_dtype)
        self.norm_attention = LayerNorm(epsilon=self.layer_norm_epsilon, name="LayerNorm_0", dtype=policy)
        self.attention = MultiHeadDotProductAttention(
            self.num_heads, self.attention_dropout_rate, qk_norm=self.qk_norm,
            layer_norm_epsilon=self.layer_norm_epsilon, name="MultiHeadDotProductAttention_1", dtype=policy)
        self.norm_mlp = LayerNorm(epsilon=self.layer_norm_epsilon, name="LayerNorm_2", dtype=policy)
        self.mlp = MlpBlock(self.mlp_dim, self.dropout_rate, self.gelu_approximate, self.activation,
                            self.gated_mlp, self.mlp_norm, self.layer_norm_epsilon, name="MlpBlock_3", dtype=policy)
        self.scale_attention, self.scale_mlp = (
            keras.layers.Identity(name=name, dtype=policy) if self.layer_scale_init is None
            else LayerScale(self.layer_scale_init, name=name, dtype=policy) for name in ("ls1", "ls2"))
        self.dropout = keras.layers.Dropout(self.dropout_rate, dtype=policy)
        self.drop_path = StochasticDepth(self.drop_path_rate, dtype=policy)
        for sublayer in (self.norm_attention, self.attention, self.norm_mlp, self.mlp, self.scale_attention,
                         self.scale_mlp, self.dropout, self.drop_path):
            sublayer.build(input_shape)

    @kernels.compiled_inference
    @kernels.rematerialized
    def call(self, x, training=None, return_attention_scores=False, output_tokens=None, rotary=None,
             attention_mask=None):
        # With output_tokens=n, the rows x_i, i < n: their queries attend to the keys and values of every token.
        rows = x if output_tokens is None else x[:, :output_tokens]
        context = None if output_tokens is None else self.norm_attention(x)
        attention = self.attention(self.norm_attention(rows), context=context, rotary=rotary, training=training,
                                   return_attention_scores=return_attention_scores, attention_mask=attention_mask)
        attended, scores = attention if return_attention_scores else (attention, None)
        y = rows + self.drop_path(self.scale_attention(self.dropout(attended, training=training)), training=training)
        out = y + self.drop_path(self.scale_mlp(self.mlp(self.norm_mlp(y), training=training)), training=training)
        return (out, scores) if return_attention_scores else out

    def compute_output_shape(self, input_shape):
        return input_shape

    def compute_output_spec(self, x, training=None, return_attention_scores=False, output_tokens=None, rotary=None,
                            attention_mask=None):
        rows = x.shape[1] if output_tokens is None else output_tokens
        output = keras.KerasTensor((x.shape[0], rows, x.shape[2]), dtype=self.compute_dtype)
        if not return_attention_scores:
            return output
        scores_shape = (x.shape[0], self.num_heads, rows, x.shape[1])
        return output, keras.KerasTensor(scores_shape, dtype=self.compute_dtype)

    def get_config(self):
        config = super().get_config()
        config.update({
            "num_heads": self.num_heads,
            "mlp_dim": self.mlp_dim,
            "dropout_rate": self.dropout_rate,
            "attention_dropout_rate": self.attention_dropout_rate,
            "drop_path_rate": self.drop_path_rate,
            "layer_norm_epsilon": self.layer_norm_epsilon,
            "gelu_approximate": self.gelu_approximate,
            "activation": self.activation,
            "layer_scale_init": self.layer_scale_init,
            "qk_norm": self.qk_norm,
            "remat": self.remat,
            "gated_mlp": self.gated_mlp,
            "mlp_norm": self.mlp_norm,
        })
        return config


@_register
class MAPHead(keras.layers.Layer):
    """Multihead attention pooling (big_vision's `MAPHead`; SigLIP, timm's `global_pool='map'`): a learned probe
    attends over the tokens, then a residual MLP:

        x = MHA(probe, tokens)              (batch, 1, D)
        out = (x + MLP(LN(x)))[:, 0]        (batch, D)

    With `token_mask`, the probe attends to the tokens it marks only (NaFlex's padded sequences).

    Sublayers carry big_vision's names: `probe`, `MultiHeadDotProductAttention_0`, `LayerNorm_0`, `MlpBlock_0`.

    Args:
        num_heads: int. Attention heads (the encoder's).
        mlp_dim: int. MLP hidden width (the encoder's).
        layer_norm_epsilon: float. Defaults to `1e-6`.
        gelu_approximate: bool. The MLP's GELU (`MlpBlock`). Defaults to `True`.
        activation: the MLP's `"gelu"`, `"quick_gelu"` or `"silu"`. Defaults to `"gelu"`.

    Call arguments:
        tokens: (batch, tokens, D).
        token_mask: optional (batch, tokens), 0 at padding tokens. Defaults to `None`: every token.
    """

    def __init__(self, num_heads: int, mlp_dim: int, layer_norm_epsilon: float = LAYER_NORM_EPSILON,
                 gelu_approximate: bool = True, activation: str = "gelu", **kwargs):
        super().__init__(**kwargs)
        self.num_heads = num_heads
        self.mlp_dim = mlp_dim
        self.layer_norm_epsilon = layer_norm_epsilon
        self.gelu_approximate = gelu_approximate
        self.activation = activation

    def build(self, input_shape):
        width, policy = input_shape[-1], self.dtype_policy
        self.probe = self.add_weight(name="probe", shape=(1, 1, width), initializer="glorot_uniform")
        self.attention = MultiHeadDotProductAttention(self.num_heads, name="MultiHeadDotProductAttention_0",
                                                      dtype=policy)
        self.norm = LayerNorm(epsilon=self.layer_norm_epsilon, name="LayerNorm_0", dtype=policy)
        self.mlp = MlpBlock(self.mlp_dim, gelu_approximate=self.gelu_approximate, activation=self.activation,
                            name="MlpBlock_0", dtype=policy)
        probe_shape = (input_shape[0], 1, width)
        self.attention.build(probe_shape)
        self.norm.build(probe_shape)
        self.mlp.build(probe_shape)

    def call(self, tokens, token_mask=None):
        probe = ops.broadcast_to(ops.cast(self.probe, tokens.dtype), (ops.shape(tokens)[0], 1, tokens.shape[-1]))
        x = self.attention(probe, context=tokens, attention_mask=token_mask)
        return kernels.token_row(x + self.mlp(self.norm(x)), 0)

    def compute_output_shape(self, input_shape):
        return (input_shape[0], input_shape[-1])

    def get_config(self):
        config = super().get_config()
        config.update({"num_heads": self.num_heads, "mlp_dim": self.mlp_dim,
                       "layer_norm_epsilon": self.layer_norm_epsilon, "gelu_approximate": self.gelu_approximate,
                       "activation": self.activation})
        return config


def transformer_blocks(model: keras.Model) -> list[TransformerBlock]:
    """The model's top-level `TransformerBlock` layers, in order.

    Raises:
        ValueError: none at the top level; when a keras_vit model is nested as a layer, the error names it.
    """
    blocks = [layer for layer in model.layers if isinstance(layer, TransformerBlock)]
    if blocks:
        return blocks
    nested = [layer.name for layer in model.layers
              if isinstance(layer, keras.Model) and any(isinstance(inner, TransformerBlock) for inner in layer.layers)]
    if nested:
        raise ValueError(f"Model {model.name!r} holds its ViT as the nested model {nested[0]!r}, whose encoder "
                         f"blocks this needs at the top level: pass model.get_layer({nested[0]!r}) instead.")
    raise ValueError(f"Model {model.name!r} has no TransformerBlock layers: expected a keras_vit model "
                     "(keras_vit.VisionTransformer, ViTB16, ...).")
