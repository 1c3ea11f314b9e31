"""Hadamard constructions and the rotation matrices, checked against their definitions.

A Hadamard matrix of order n has entries ±1 and ``H Hᵀ = n I`` exactly (integer arithmetic in float64, so
the test is an equality); an orthogonal float64 matrix built from it or from a QR factor is orthogonal to
float64 rounding (1e-12 here, orders up to 576).
"""

from __future__ import annotations

import pytest
import torch

from normswap.rotate import hadamard as had
from normswap.rotate.matrix import generator, householder_ones, make


def _is_hadamard(h: torch.Tensor) -> bool:
    n = h.shape[0]
    return (
        h.shape == (n, n)
        and bool((h.abs() == 1).all())
        and torch.equal(h @ h.T, n * torch.eye(n, dtype=torch.float64))
    )


# QuaRot's small orders (but 156 and 172), powers of two, and orders reached only by Paley over GF(p^k)
# (28 = 27 + 1, 52 = 2 (25 + 1), 100 = 2 (49 + 1)) or by Kronecker products (40, 1600 is too large here)
ORDERS = [1, 2, 4, 8, 12, 20, 28, 36, 40, 44, 52, 60, 68, 76, 84, 100, 108, 140, 192, 576]


@pytest.mark.parametrize("n", ORDERS)
def test_constructions_are_hadamard(n):
    built = had.hadamard(n)
    assert built is not None, n
    h, description = built
    assert h.dtype == torch.float64 and _is_hadamard(h), description


def test_orders_without_a_construction():
    """Orders that are not 1, 2 or a multiple of 4 have no Hadamard matrix; 92, 156 and 172 need Williamson
    matrices (computer search), which this module does not build; twice 156 and 172 come from Paley I
    (312 = 311 + 1, 344 = 7^3 + 1)."""
    for n in (3, 6, 10, 18, 30, 92, 156, 172):
        assert had.hadamard(n) is None, n
    assert had.construction(312) == ("paley1", 311) and had.construction(344) == ("paley1", 343)
    assert _is_hadamard(had.hadamard(344)[0])


def test_recipes_prefer_sylvester_times_a_small_order():
    assert had.describe(had.construction(576)) == "Sylvester 16 x Paley II (q=17) 36"
    assert had.describe(had.construction(3584)) == "Sylvester 128 x Paley I (q=27) 28"
    assert had.construction(4096) == ("sylvester", 4096)


@pytest.mark.parametrize("q", [7, 9, 11, 13, 25, 27, 49])
def test_jacobsthal_matrix(q):
    """Paley's lemma: for the Jacobsthal matrix J of GF(q), J Jᵀ = q I - 1 1ᵀ and every row sums to 0; J is
    symmetric for q = 1 (mod 4), skew for q = 3 (mod 4)."""
    j = had.jacobsthal(q)
    ones = torch.ones((q, q), dtype=torch.float64)
    assert torch.equal(j @ j.T, q * torch.eye(q, dtype=torch.float64) - ones)
    assert torch.equal(j.sum(1), torch.zeros(q, dtype=torch.float64))
    assert torch.equal(j.T, j if q % 4 == 1 else -j)


@pytest.mark.parametrize("p,k", [(2, 3), (3, 2), (3, 3), (5, 2)])
def test_galois_field_squares(p, k):
    """GF(p^k) built on the irreducible polynomial found by search: multiplication has no zero divisors
    (the polynomial is irreducible), and the non-zero squares are half of the non-zero elements (odd p)."""
    field = had.GaloisField(p, k)
    q = p**k
    for a in range(1, q):
        for b in range(1, q):
            product = field._mulmod(field.digits(a), field.digits(b), field.modulus)
            assert any(product), (a, b)
    if p % 2:
        assert len(field.squares()) == (q - 1) // 2


@pytest.mark.parametrize("kind", ["hadamard", "random"])
@pytest.mark.parametrize("keep_ones", [False, True])
def test_matrices_are_orthogonal(kind, keep_ones):
    m = make("Q", 576, kind, generator(0), keep_ones=keep_ones)
    q = m.values
    eye = torch.eye(576, dtype=torch.float64)
    assert (q @ q.T - eye).abs().max().item() <= 1e-12
    assert m.kind == kind and m.keeps_ones == keep_ones
    if keep_ones:
        ones = torch.ones(576, dtype=torch.float64)
        assert (q @ ones - ones).abs().max().item() <= 1e-12
        assert (q.T @ ones - ones).abs().max().item() <= 1e-12
    if kind == "hadamard" and not keep_ones:  # diag(s) H / sqrt(n): every entry +-1/sqrt(n)
        assert torch.allclose(q.abs(), torch.full_like(q, 576**-0.5), rtol=0, atol=1e-15)


def test_matrices_follow_the_seed():
    a = make("Q", 64, "hadamard", generator(1)).values
    assert torch.equal(a, make("Q", 64, "hadamard", generator(1)).values)
    assert not torch.equal(a, make("Q", 64, "hadamard", generator(2)).values)
    r = make("Q", 64, "random", generator(1)).values
    assert torch.equal(r, make("Q", 64, "random", generator(1)).values)


def test_hadamard_falls_back_to_random_and_says_so():
    m = make("Q", 156, "hadamard", generator(0))
    assert m.kind == "random" and "no Hadamard construction here reaches order 156" in m.description
    assert (m.values @ m.values.T - torch.eye(156, dtype=torch.float64)).abs().max().item() <= 1e-12


def test_householder_keeps_a_matrix_that_already_keeps_ones():
    eye = torch.eye(8, dtype=torch.float64)
    assert torch.equal(householder_ones(eye), eye)
