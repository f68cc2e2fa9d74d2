"""An independent reference for the Edgeworth accountant's series, in 40-digit mpmath.

The approximate Edgeworth accountant (AEA) of Wang, Gao, Zhang, Shen and Su (2022, "Analytical
composition of differential privacy via the Edgeworth accountant", arXiv 2206.04236, Def. 4.1):
P(S > x) ~ Phi(-z) + phi(z) c(z) from the summed cumulants of the composed privacy loss under
each of P and Q, delta(eps) = P(S_P > eps) - e^eps P(S_Q > eps) per adjacency direction (tails
clipped to [0, 1], each direction's delta at least 0, the worse direction kept: jaxacct's
convention). Per-step cumulants of the Poisson-subsampled Gaussian's loss come from mpmath
quadrature. Nothing here imports jaxacct.

``python tests/edgeworth_reference.py`` prints the values the tests assert that are too slow to
compute in them (five-point central differences of epsilon and delta);
``python tests/edgeworth_reference.py tables`` prints the tables of tests/test_edgeworth.py
(per-step cumulants and absolute central moments, AEA deltas and epsilons, the roots at m = 20).
"""

import sys

import mpmath as mp

mp.mp.dps = 40


def step_cumulants(q, sigma, under_p):
  """kappa_1..kappa_5 of one step's loss L = log(1 - q + q e^{mu x - mu^2/2}), mu = 1/sigma,
  x ~ N(0, 1) (under Q) or x ~ (1 - q) N(0, 1) + q N(mu, 1) (under P)."""
  q, mu = mp.mpf(q), 1 / mp.mpf(sigma)
  loss = lambda x: mp.log(1 - q + q * mp.exp(mu * x - mu * mu / 2))
  density = ((lambda x: (1 - q) * mp.npdf(x) + q * mp.npdf(x, mu, 1)) if under_p else mp.npdf)
  points = [-mp.inf, -12, -4, 0, mu, 4 + mu, 12 + mu, mp.inf]
  mean = mp.quad(lambda x: density(x) * loss(x), points)
  c2, c3, c4, c5 = (mp.quad(lambda x: density(x) * (loss(x) - mean) ** k, points)
                    for k in (2, 3, 4, 5))
  return [mean, c2, c3, c4 - 3 * c2 ** 2, c5 - 10 * c3 * c2]


def absolute_moments(q, sigma, under_p):
  """E|L - E L| and E|L - E L|^3 of one step's loss (laws as in ``step_cumulants``), the
  quadrature split where L crosses its mean (L is increasing in x)."""
  q, mu = mp.mpf(q), 1 / mp.mpf(sigma)
  loss = lambda x: mp.log(1 - q + q * mp.exp(mu * x - mu * mu / 2))
  density = ((lambda x: (1 - q) * mp.npdf(x) + q * mp.npdf(x, mu, 1)) if under_p else mp.npdf)
  points = [-mp.inf, -12, -4, 0, mu, 4 + mu, 12 + mu, mp.inf]
  mean = mp.quad(lambda x: density(x) * loss(x), points)
  kink = mp.findroot(lambda x: loss(x) - mean, mu / 2)
  split = sorted([p for p in points if p != kink] + [kink])
  return [mp.quad(lambda x: density(x) * abs(loss(x) - mean) ** k, split) for k in (1, 3)]


def _tail(x, k, order):
  """The order-``order`` Edgeworth approximation of P(S > x), summed cumulants k[0..4]."""
  b = mp.sqrt(k[1])
  z = (x - k[0]) / b
  r3, r4, r5 = k[2] / b ** 3, k[3] / b ** 4, k[4] / b ** 5
  he = [mp.mpf(1), z]
  for n in range(1, 8):
    he.append(z * he[n] - n * he[n - 1])
  c = r3 / 6 * he[2]
  if order >= 2:
    c += r4 / 24 * he[3] + r3 ** 2 / 72 * he[5]
  if order >= 3:
    c += r5 / 120 * he[4] + r3 * r4 / 144 * he[6] + r3 ** 3 / 1296 * he[8]
  return mp.ncdf(-z) + mp.npdf(z) * c


def aea_delta(eps, under_q, under_p, steps, order):
  """delta(eps) of the AEA for ``steps`` identical steps with per-step cumulants under Q and P
  (remove direction; the add direction's laws are the mirror images: X' = -Y, Y' = -X)."""
  eps, m = mp.mpf(eps), mp.mpf(steps)
  flip = [(-1) ** r for r in range(1, 6)]
  directions = [([m * k for k in under_p], [m * k for k in under_q]),
                ([m * f * k for f, k in zip(flip, under_q)],
                 [m * f * k for f, k in zip(flip, under_p)])]
  clip = lambda v: min(max(v, 0), 1)
  return max(max(clip(_tail(eps, kp, order)) - mp.exp(eps) * clip(_tail(eps, kq, order)), 0)
             for kp, kq in directions)


def largest_root(delta_of, delta, high, points=400):
  """The largest eps in [0, high] where delta_of(eps) falls to ``delta`` (a scan from the top,
  then bisection to 1e-30)."""
  delta = mp.mpf(delta)
  grid = [high * mp.mpf(i) / points for i in range(points + 1)]
  above = [delta_of(e) > delta for e in grid]
  for i in range(points, 0, -1):
    if above[i - 1] and not above[i]:
      lo, hi = grid[i - 1], grid[i]
      while hi - lo > mp.mpf("1e-30"):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if delta_of(mid) > delta else (lo, mid)
      return (lo + hi) / 2
  return None


def _derivative(f, x, h):
  """Five-point central difference (error O(h^4))."""
  return (f(x - 2 * h) - 8 * f(x - h) + 8 * f(x + h) - f(x + 2 * h)) / (12 * h)


def main():
  q, sigma, steps, delta, eps = mp.mpf("0.01"), mp.mpf("0.8"), mp.mpf(1000), mp.mpf("0.015"), 1
  laws = lambda q, s: (step_cumulants(q, s, False), step_cumulants(q, s, True))
  def epsilon(q, s, m):
    under_q, under_p = laws(q, s)  # once per point: the root takes hundreds of evaluations
    return largest_root(lambda e: aea_delta(e, under_q, under_p, m, 2), delta, 3)

  print("d eps / d (sigma, q, T):",
        mp.nstr(_derivative(lambda s: epsilon(q, s, steps), sigma, mp.mpf("1e-3")), 12),
        mp.nstr(_derivative(lambda v: epsilon(v, sigma, steps), q, mp.mpf("1e-5")), 12),
        mp.nstr(_derivative(lambda m: epsilon(q, sigma, m), steps, mp.mpf("0.5")), 12))
  under_q, under_p = laws(q, sigma)
  print("delta(1):", mp.nstr(aea_delta(eps, under_q, under_p, steps, 2), 14))
  print("d delta / d (sigma, eps):",
        mp.nstr(_derivative(lambda s: aea_delta(eps, *laws(q, s), steps, 2), sigma,
                            mp.mpf("1e-3")), 12),
        mp.nstr(_derivative(lambda e: aea_delta(e, under_q, under_p, steps, 2), eps,
                            mp.mpf("1e-4")), 12))


def tables():
  """The reference values of tests/test_edgeworth.py that need no derivatives."""
  laws = {}
  for q, sigma in (("0.01", "0.8"), ("0.05", "1.0"), ("0.0005", "1.0"), ("0.1", "0.8"),
                   ("0.004", "0.8")):
    laws[q, sigma] = (step_cumulants(q, sigma, False), step_cumulants(q, sigma, True))
    print("cumulants", q, sigma, "under Q:", [mp.nstr(v, 13) for v in laws[q, sigma][0]])
    print("cumulants", q, sigma, "under P:", [mp.nstr(v, 13) for v in laws[q, sigma][1]])
  for q, sigma in (("0.01", "0.8"), ("0.05", "1.0")):
    for under_p in (False, True):
      print("E|d|, E|d|^3", q, sigma, "under", "P:" if under_p else "Q:",
            [mp.nstr(v, 10) for v in absolute_moments(q, sigma, under_p)])
  for q, sigma, steps, eps in (("0.01", "0.8", 1000, 1), ("0.01", "0.8", 2000, "1.5"),
                               ("0.05", "1.0", 200, 4), ("0.0005", "1.0", 20000, "0.3"),
                               ("0.004", "0.8", 10000, "0.7")):
    value = aea_delta(eps, *laws[q, sigma], steps, 2)
    print("AEA2 delta", q, sigma, steps, eps, mp.nstr(value, 12))
  print("AEA1 delta 0.05 1.0 200 4", mp.nstr(aea_delta(4, *laws["0.05", "1.0"], 200, 1), 12))
  for q, sigma, delta, steps, high in (("0.01", "0.8", "0.015", 100, 3),
                                       ("0.01", "0.8", "0.015", 1000, 3),
                                       ("0.01", "0.8", "0.015", 2000, 3),
                                       ("0.05", "1.0", "1e-5", 20, 8),
                                       ("0.05", "1.0", "1e-5", 200, 8)):
    print("AEA1..3 epsilon", q, sigma, delta, steps,
          [mp.nstr(largest_root(lambda e: aea_delta(e, *laws[q, sigma], steps, order), delta, high),
                   12) for order in (1, 2, 3)])
  # m = 20, q = 0.01, sigma = 0.8: every crossing of delta = 0.015 by AEA2 on [0, 0.4].
  f = lambda e: aea_delta(e, *laws["0.01", "0.8"], 20, 2) - mp.mpf("0.015")
  grid = [mp.mpf(i) / 4000 for i in range(1601)]
  values = [f(e) for e in grid]
  print("AEA2 roots at m = 20:", [mp.nstr(mp.findroot(f, (a, b), solver="anderson"), 8)
                                  for a, b, fa, fb in zip(grid, grid[1:], values, values[1:])
                                  if fa * fb < 0])


if __name__ == "__main__":
  tables() if sys.argv[1:] == ["tables"] else main()
