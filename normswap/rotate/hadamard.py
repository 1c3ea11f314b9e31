"""Hadamard matrices built from known constructions: ``H`` of order ``n`` with ``±1`` entries and
``H @ H.T == n * I``.

Constructions (Seberry and Yamada, "Hadamard Matrices", Wiley 2020, ch. 1-2; Horadam, "Hadamard Matrices
and Their Applications", 2007, sec. 1.2):

* **Sylvester**: ``H(2) = [[1, 1], [1, -1]]``, ``H(ab) = H(a) ⊗ H(b)`` (a Kronecker product of Hadamard
  matrices is one);
* **Paley I**, ``n = q + 1`` for a prime power ``q ≡ 3 (mod 4)``: with the Jacobsthal matrix
  ``J[a, b] = χ(a - b)`` over GF(q) (``χ`` the quadratic character: 1 on non-zero squares, -1 on
  non-squares, 0 at 0), ``S = [[0, 1ᵀ], [-1, J]]`` is skew and ``H = I + S``;
* **Paley II**, ``n = 2(q + 1)`` for a prime power ``q ≡ 1 (mod 4)``: ``C = [[0, 1ᵀ], [1, J]]`` is a
  symmetric conference matrix and ``H = C ⊗ [[1, 1], [1, -1]] + I ⊗ [[1, -1], [-1, -1]]``.

``construction(n)`` finds a recipe as a Kronecker product of these, preferring the largest power-of-two
Sylvester factor (as QuaRot's ``get_hadK`` does: ``n = 2^k · m`` with ``m`` one of a few small orders).
This covers QuaRot's orders 12, 20, 28, 36, 40, 52, 60, 108, 140 times powers of two (and many more:
44, 68, 76, 84, 100, ...), and 156 and 172 times 2^k for k >= 1 (312 = 311 + 1 and 344 = 7^3 + 1 are Paley I
orders), but not 156 and 172 themselves (nor 92), which need Williamson matrices found by computer search:
``hadamard`` returns None for those and for any order with no recipe here (the caller then uses a random
orthogonal matrix and says so). Every Paley factor is checked (``H Hᵀ = n I``) as it is built.
"""

from __future__ import annotations

import functools
import itertools

import torch

Recipe = tuple  # ("sylvester", n) | ("paley1", q) | ("paley2", q) | ("kron", recipe, recipe)


def _factor(n: int) -> dict[int, int]:
    """Prime factorization ``{p: k}`` of ``n >= 1`` by trial division (``n`` is at most a few 100000)."""
    out: dict[int, int] = {}
    p = 2
    while p * p <= n:
        while n % p == 0:
            out[p] = out.get(p, 0) + 1
            n //= p
        p += 1
    if n > 1:
        out[n] = out.get(n, 0) + 1
    return out


def prime_power(q: int) -> tuple[int, int] | None:
    """``(p, k)`` with ``q = p^k`` for a prime ``p``, or None."""
    if q < 2:
        return None
    factors = _factor(q)
    return next(iter(factors.items())) if len(factors) == 1 else None


def _is_power_of_two(n: int) -> bool:
    return n >= 1 and n & (n - 1) == 0


MAX_PALEY_Q = 4096  # the Jacobsthal matrix of GF(q) is q x q: larger fields are left to Kronecker products


def _direct(n: int) -> Recipe | None:
    """A recipe for order ``n`` without a Kronecker product, or None."""
    if _is_power_of_two(n):
        return ("sylvester", n)
    q = n - 1
    if q <= MAX_PALEY_Q and q % 4 == 3 and prime_power(q):
        return ("paley1", q)
    if n % 2 == 0:
        q = n // 2 - 1
        if q <= MAX_PALEY_Q and q % 4 == 1 and prime_power(q):
            return ("paley2", q)
    return None


@functools.cache
def construction(n: int) -> Recipe | None:
    """How to build a Hadamard matrix of order ``n`` (a recipe, see ``Recipe``), or None when no
    construction here reaches ``n``.

    Orders other than 1, 2 and multiples of 4 have no Hadamard matrix at all.
    """
    if n < 1 or (n > 2 and n % 4):
        return None
    two = n & -n  # the largest power of two dividing n
    # n = 2^j * m, the largest power of two first, m built directly (QuaRot's layout)
    j = two
    while j >= 1:
        m = n // j
        direct = _direct(m)
        if direct is not None:
            return direct if j == 1 else (("kron", ("sylvester", j), direct) if m > 1 else ("sylvester", j))
        j //= 2
    # any split into two constructible factors (e.g. 20 x 20 x 4 = 1600)
    for a in range(4, int(n**0.5) + 1, 4):
        if n % a == 0 and construction(a) is not None and construction(n // a) is not None:
            return ("kron", construction(a), construction(n // a))
    return None


def describe(recipe: Recipe) -> str:
    """A short human description: ``"Sylvester 16 x Paley II (q=17) 36"``."""
    kind = recipe[0]
    if kind == "sylvester":
        return f"Sylvester {recipe[1]}"
    if kind == "paley1":
        return f"Paley I (q={recipe[1]}) {recipe[1] + 1}"
    if kind == "paley2":
        return f"Paley II (q={recipe[1]}) {2 * (recipe[1] + 1)}"
    return f"{describe(recipe[1])} x {describe(recipe[2])}"


class GaloisField:
    """GF(p^k): elements ``0 .. q-1`` read as the base-``p`` digits of a polynomial (digit ``i`` is the
    coefficient of ``x^i``), reduced modulo a monic irreducible polynomial of degree ``k`` found by search.
    """

    def __init__(self, p: int, k: int):
        self.p, self.k, self.q = p, k, p**k
        self.modulus = self._irreducible() if k > 1 else None

    def digits(self, a: int) -> list[int]:
        return [(a // self.p**i) % self.p for i in range(self.k)]

    def number(self, digits: list[int]) -> int:
        return sum(d * self.p**i for i, d in enumerate(digits))

    def _mulmod(self, a: list[int], b: list[int], modulus: list[int]) -> list[int]:
        """``a * b`` reduced modulo the monic ``modulus`` (coefficient lists, low degree first)."""
        p, deg = self.p, len(modulus) - 1
        prod = [0] * (len(a) + len(b) - 1)
        for i, x in enumerate(a):
            for j, y in enumerate(b):
                prod[i + j] = (prod[i + j] + x * y) % p
        for top in range(len(prod) - 1, deg - 1, -1):  # subtract multiples of the monic modulus
            c = prod[top]
            if c:
                for i, m in enumerate(modulus):
                    prod[top - deg + i] = (prod[top - deg + i] - c * m) % p
        return (prod + [0] * deg)[:deg]

    def _irreducible(self) -> list[int]:
        """The first monic polynomial of degree ``k`` (coefficients low first) with no root and no factor of
        degree <= k/2: checked by trying every monic divisor of degree 1 .. k//2."""
        p, k = self.p, self.k
        for tail in itertools.product(range(p), repeat=k):
            f = [*tail, 1]
            if f[0] == 0:
                continue
            if not any(self._divides(g, f) for d in range(1, k // 2 + 1) for g in self._monic(d)):
                return f
        raise AssertionError(f"no irreducible polynomial of degree {k} over GF({p})")  # cannot happen

    def _monic(self, degree: int):
        for tail in itertools.product(range(self.p), repeat=degree):
            yield [*tail, 1]

    def _divides(self, g: list[int], f: list[int]) -> bool:
        """Whether monic ``g`` divides ``f`` over GF(p) (polynomial long division)."""
        rest, p, dg = list(f), self.p, len(g) - 1
        for top in range(len(rest) - 1, dg - 1, -1):
            c = rest[top]
            if c:
                for i, m in enumerate(g):
                    rest[top - dg + i] = (rest[top - dg + i] - c * m) % p
        return not any(rest[:dg])

    def squares(self) -> set[int]:
        """The non-zero squares of the field."""
        if self.k == 1:
            return {(a * a) % self.p for a in range(1, self.q)}
        square = [self._mulmod(self.digits(a), self.digits(a), self.modulus) for a in range(1, self.q)]
        return {self.number(s) for s in square}


def jacobsthal(q: int) -> torch.Tensor:
    """The ``q x q`` Jacobsthal matrix ``J[a, b] = χ(a - b)`` of GF(q) (float64, entries 0 and ±1)."""
    p, k = prime_power(q)
    field = GaloisField(p, k)
    chi = torch.full((q,), -1.0, dtype=torch.float64, device="cpu")
    chi[0] = 0.0
    chi[sorted(field.squares())] = 1.0
    if k == 1:
        a = torch.arange(q, device="cpu")
        return chi[(a[:, None] - a[None, :]) % q]
    powers = p ** torch.arange(k, device="cpu")
    digits = (torch.arange(q, device="cpu")[:, None] // powers) % p  # (q, k): coefficients, low first
    diff = ((digits[:, None, :] - digits[None, :, :]) % p * powers).sum(-1)  # a - b, digit by digit
    return chi[diff]


def _paley1(q: int) -> torch.Tensor:
    n = q + 1
    s = torch.zeros((n, n), dtype=torch.float64, device="cpu")
    s[0, 1:], s[1:, 0], s[1:, 1:] = 1.0, -1.0, jacobsthal(q)
    return torch.eye(n, dtype=torch.float64, device="cpu") + s


def _paley2(q: int) -> torch.Tensor:
    n = q + 1
    c = torch.zeros((n, n), dtype=torch.float64, device="cpu")
    c[0, 1:], c[1:, 0], c[1:, 1:] = 1.0, 1.0, jacobsthal(q)
    plus = torch.tensor([[1.0, 1.0], [1.0, -1.0]], dtype=torch.float64, device="cpu")
    minus = torch.tensor([[1.0, -1.0], [-1.0, -1.0]], dtype=torch.float64, device="cpu")
    return torch.kron(c, plus) + torch.kron(torch.eye(n, dtype=torch.float64, device="cpu"), minus)


def _sylvester(n: int) -> torch.Tensor:
    h = torch.ones((1, 1), dtype=torch.float64, device="cpu")
    base = torch.tensor([[1.0, 1.0], [1.0, -1.0]], dtype=torch.float64, device="cpu")
    while h.shape[0] < n:
        h = torch.kron(h, base)
    return h


def build(recipe: Recipe) -> torch.Tensor:
    """The matrix of ``recipe`` (float64, CPU, entries ±1).

    Each Paley factor is checked (``is_hadamard``) as it is built; Sylvester's matrices and Kronecker
    products of Hadamard matrices are Hadamard by construction, so a large order costs no ``n^3`` check.

    Raises:
        AssertionError: a Paley factor is not a Hadamard matrix (a bug in this module).
    """
    kind = recipe[0]
    if kind == "sylvester":
        return _sylvester(recipe[1])
    if kind == "kron":
        return torch.kron(build(recipe[1]), build(recipe[2]))
    h = _paley1(recipe[1]) if kind == "paley1" else _paley2(recipe[1])
    if not is_hadamard(h):
        raise AssertionError(f"the {describe(recipe)} construction is not a Hadamard matrix")
    return h


def is_hadamard(h: torch.Tensor) -> bool:
    """Whether ``h`` is square with entries ±1 and ``h @ h.T == n I`` exactly (float64: integer sums)."""
    n = h.shape[0]
    if h.ndim != 2 or h.shape[1] != n or not bool((h.abs() == 1).all()):
        return False
    return torch.equal(h @ h.T, n * torch.eye(n, dtype=h.dtype, device=h.device))


def hadamard(n: int) -> tuple[torch.Tensor, str] | None:
    """A Hadamard matrix of order ``n`` and its description, or None when no construction here reaches ``n``.

    Returns:
        ``(H, description)``: ``H`` float64 on the CPU, entries ±1, ``H Hᵀ = n I`` (see ``build``).

    Raises:
        AssertionError: a Paley factor is not a Hadamard matrix (a bug in this module).
    """
    recipe = construction(n)
    return None if recipe is None else (build(recipe), describe(recipe))
