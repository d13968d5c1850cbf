"""What the transformer models share: their sizes, the check that a sequence fits, and one
layer in its two arrangements (BERT's post-norm encoder layer, GPT-2's pre-norm decoder
layer)."""

from __future__ import annotations

import flax.linen as nn
import jax


class TokenModel(nn.Module):
  """A transformer over ``(B, L)`` int32 token ids; its sizes come from ``models.MODELS``."""

  vocab_size: int
  hidden: int
  layers: int
  heads: int
  ffn: int
  max_len: int
  dropout_rate: float = 0.1
  # nanoGPT's GPT: no biases in the linear layers and norms (bias=False), and every weight
  # drawn from N(0, init_std^2), the residual projections from N(0, init_std^2 / (2 layers)).
  # None: Flax's default initializers.
  bias: bool = True
  init_std: float | None = None

  def embed(self, num: int, name: str) -> nn.Embed:
    """A token or position embedding, drawn as ``init_std`` says."""
    init = ({} if self.init_std is None
            else {"embedding_init": nn.initializers.normal(self.init_std)})
    return nn.Embed(num, self.hidden, name=name, **init)

  def block_init(self) -> dict | None:
    """:class:`Block`'s ``init``: its kernels' and residual projections' initializers."""
    if self.init_std is None:
      return None
    return {"kernel": nn.initializers.normal(self.init_std),
            "out": nn.initializers.normal(self.init_std / (2 * self.layers) ** 0.5)}

  def check_length(self, tokens: jax.Array) -> None:
    """A clear error for a sequence longer than the position embeddings."""
    if tokens.shape[1] > self.max_len:
      raise ValueError(f"{type(self).__name__}: sequence length {tokens.shape[1]} exceeds "
                       f"max_len {self.max_len}; pass a shorter --seq-len.")


class Block(nn.Module):
  """A transformer layer: self-attention, then a GELU feed-forward, each around a residual."""

  hidden: int
  heads: int
  ffn: int
  dropout_rate: float
  pre_norm: bool = False
  bias: bool = True
  init: dict | None = None  # {"kernel": ..., "out": ...} initializers; None: Flax's

  @nn.compact
  def __call__(self, x, mask, train: bool):
    drop = nn.Dropout(self.dropout_rate, deterministic=not train)
    kernel = {} if self.init is None else {"kernel_init": self.init["kernel"]}
    out = {} if self.init is None else {"kernel_init": self.init["out"]}
    dense = lambda n, k: nn.Dense(n, use_bias=self.bias, **k)  # noqa: E731
    attend = nn.MultiHeadDotProductAttention(
        self.heads, dropout_rate=self.dropout_rate, deterministic=not train,
        use_bias=self.bias, **kernel,
        **({} if self.init is None else {"out_kernel_init": self.init["out"]}))
    if self.pre_norm:  # GPT-2: each sublayer normalizes its input; tanh-approximated GELU
      norm = lambda: nn.LayerNorm(use_bias=self.bias)  # noqa: E731
      x = x + drop(attend(norm()(x), mask=mask))
      return x + drop(dense(self.hidden, out)(nn.gelu(dense(self.ffn, kernel)(norm()(x)))))
    # BERT: the residual sum is normalized after each sublayer; exact GELU
    x = nn.LayerNorm(epsilon=1e-12)(x + drop(attend(x, mask=mask)))
    y = nn.Dense(self.hidden)(nn.gelu(nn.Dense(self.ffn)(x), approximate=False))
    return nn.LayerNorm(epsilon=1e-12)(x + drop(y))


class EncoderLayer(Block):
  """BERT's post-norm layer (bidirectional attention: the mask is the padding's)."""


class DecoderLayer(Block):
  """GPT-2's pre-norm layer (causal attention: the mask is the causal one)."""

  pre_norm: bool = True
