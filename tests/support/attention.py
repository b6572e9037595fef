"""The attention inputs that the tests of CompPO's attention statistics share
(``tests/models/test_concentration*.py``): random queries and keys, and the shapes that cover GQA, Tq < Tk, a
row that sees one key and chunk sizes that do not divide T. Their dense float64 reference is
:func:`tests.references.dense_attention`."""
import torch


def attention_inputs(b, hq, hkv, tq, tk, d, *, seed=0, dtype=torch.float32, spread=2.0):
    g = torch.Generator().manual_seed(seed)
    # spread > 1 gives peaked rows (H far from 1/n) as well as flat ones.
    q = (torch.randn(b, hq, tq, d, generator=g) * spread).to(dtype)
    k = torch.randn(b, hkv, tk, d, generator=g).to(dtype)
    return q, k


ATTENTION_CASES = [  # b, hq, hkv, tq, tk, d, chunk
    (2, 8, 2, 37, 37, 16, 8),     # Tq == Tk: row 0 sees one key (n = 1, H = 1); 8 does not divide 37
    (1, 8, 2, 20, 53, 16, 16),    # Tq < Tk, GQA 4:1
    (2, 4, 4, 33, 33, 8, 1024),   # MHA, one chunk
    (1, 6, 3, 50, 70, 32, 7),     # odd chunk
]
