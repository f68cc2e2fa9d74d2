"""An independent reference for the privacy loss's cumulant generating function and the
saddle-point accountant, in 30-digit mpmath. Nothing here imports jaxacct.

Alghamdi, Asoodeh, Calmon, Gomez, Kosut, Sankar and Wei (2022, "The Saddle-Point Accountant for
Differential Privacy", arXiv 2208.09595): K(t) = log E_P[e^{tL}] of the privacy loss
L = log dP/dQ under P (Sec. 3.1); its derivatives are the cumulants of the tilted loss, density
e^{tL - K(t)} dP. For n identical steps: the saddle point t0 solves
n K'(t0) = eps + 1/t0 + 1/(1 + t0) (eq. (6)); SP-CLT is eq. (66) in the closed form of Prop. 6;
SP-MSD0 and SP-MSD1 are eqs. (60)-(61) (Sec. 3.3.1); the error bound is Theorem 5 (Sec. 4.1,
eqs. (74)-(76)) with Berry-Esseen's 2C = 1.12 (Shevtsova 2010) and
rho = n E|L_t - K'(t)|^3. eps(delta) of each follows the saddle curve eps(t) = n K'(t) - 1/t -
1/(1 + t). Each direction (remove, add) is computed; an accountant reports the worse.
The improved RDP conversion (eq. (43); Canonne, Kamath and Steinke 2020, arXiv 2004.00010,
Prop. 12) is minimised over a continuous order alpha = 1 + t.

Laws: the Poisson-subsampled Gaussian (rate q, noise sigma, sensitivity 1; remove:
P = (1-q) N(0, sigma^2) + q N(1, sigma^2), Q = N(0, sigma^2); add: swapped), the Gaussian
mechanism (L ~ N(mu^2/2, mu^2), closed form) and the Laplace mechanism (scale b, sensitivity 1:
atoms at +e0 (mass 1/2) and -e0 (e^{-e0}/2), density e^{(l - e0)/2}/4 on (-e0, e0), e0 = 1/b).

``python tests/spa_reference.py`` prints the reference values of tests/test_spa.py and
tests/test_rdp.py (half an hour); ``python tests/spa_reference.py truths`` the exact deltas and the
epsilon of tests/test_spa.py by the integral representation (eq. (37); half an hour).
"""

import sys

import mpmath as mp

mp.mp.dps = 30


class SubsampledGaussian:
  """One step of the Poisson-subsampled Gaussian; expectations under P of g(L) e^{tL}."""

  def __init__(self, q, sigma, add=False):
    self.q, self.mu, self.add = mp.mpf(q), 1 / mp.mpf(sigma), add

  def _loss(self, x):
    return mp.log(1 - self.q + self.q * mp.exp(self.mu * x - self.mu ** 2 / 2))

  def expect(self, g, t, centre=None):
    """E_P[g(L) e^{tL}] over x ~ N(0, 1): remove, e^{(1+t) L(x)} dQ; add, L = -L(x) under
    N(0, 1). ``centre``: a loss value where g has a kink (a split point)."""
    mu = self.mu
    if self.add:
      f = lambda x: mp.npdf(x) * mp.exp(-t * self._loss(x)) * g(-self._loss(x))
      peak = mp.mpf(0)
    else:
      f = lambda x: mp.npdf(x) * mp.exp((1 + t) * self._loss(x)) * g(self._loss(x))
      peak = (1 + mp.re(t)) * mu
    points = {-mp.inf, mp.inf, mp.mpf(-10), mp.mpf(0), mp.mpf(10), peak - 8, peak - 3, peak,
              peak + 3, peak + 8}
    if centre is not None:
      sign = -1 if self.add else 1
      points.add(mp.findroot(lambda x: sign * self._loss(x) - centre, peak))
    return mp.quad(f, sorted(points))


class Laplace:
  """One step of the Laplace mechanism (symmetric: both directions alike)."""

  def __init__(self, b):
    self.e0 = 1 / mp.mpf(b)

  def expect(self, g, t, centre=None):
    e0 = self.e0
    atoms = mp.exp(t * e0) * g(e0) / 2 + mp.exp(-e0) * mp.exp(-t * e0) * g(-e0) / 2
    points = [-e0, e0] if centre is None or not -e0 < centre < e0 else [-e0, centre, e0]
    return atoms + mp.quad(lambda l: mp.exp((l - e0) / 2) / 4 * mp.exp(t * l) * g(l), points)


def tilted(law, t, order=4, with_rho=True):
  """(K, K', ..., K^(order)) of one step at tilt t, then rho = E|L_t - K'(t)|^3."""
  t = mp.mpf(t)
  if isinstance(law, tuple):  # ("gaussian", mu): closed form
    mu = mp.mpf(law[1])
    out = [mu ** 2 * t * (t + 1) / 2, mu ** 2 * (t + mp.mpf(1) / 2), mu ** 2, mp.mpf(0),
           mp.mpf(0)][:order + 1]
    return out + [2 * mp.sqrt(2 / mp.pi) * mu ** 3] if with_rho else out
  m0 = law.expect(lambda l: 1, t)
  mean = law.expect(lambda l: l, t) / m0 if order >= 1 or with_rho else None
  c = {k: law.expect(lambda l: (l - mean) ** k, t) / m0 for k in range(2, order + 1)}
  out = [mp.log(m0), mean, c.get(2), c.get(3), c[4] - 3 * c[2] ** 2 if order >= 4 else None]
  out = out[:order + 1]
  if with_rho:
    out.append(law.expect(lambda l: abs(l - mean) ** 3, t, centre=mean) / m0)
  return out


def saddle_terms(law, steps, t, eps=None, with_err=True):
  """At tilt t for ``steps`` steps: eps (given, or the saddle curve's eps(t)) and the SP-CLT,
  SP-MSD0, SP-MSD1 deltas and Theorem 5's error there (``with_err``)."""
  t, n = mp.mpf(t), mp.mpf(steps)
  values = [n * v for v in tilted(law, t, 4, with_err)]
  (k, k1, k2, k3, k4), rho = values[:5], values[5] if with_err else mp.nan
  eps = k1 - 1 / t - 1 / (1 + t) if eps is None else mp.mpf(eps)
  scale = mp.exp(k - eps * t)
  m, s = k1 - eps, mp.sqrt(k2)
  a = t * s - m / s
  clt = scale * (mp.exp(-t * m + (t * s) ** 2 / 2) * mp.ncdf(-a)
                 - mp.exp(-(1 + t) * m + ((1 + t) * s) ** 2 / 2) * mp.ncdf(-a - s))
  p2 = k2 + 1 / t ** 2 + 1 / (1 + t) ** 2
  p3 = k3 - 2 / t ** 3 - 2 / (1 + t) ** 3
  p4 = k4 + 6 / t ** 4 + 6 / (1 + t) ** 4
  msd0 = scale / (t * (1 + t) * mp.sqrt(2 * mp.pi * p2))
  msd1 = msd0 * (1 + p4 / (8 * p2 ** 2) - 5 * p3 ** 2 / (24 * p2 ** 3))
  err = mp.mpf("1.12") * scale * t ** t / (1 + t) ** (1 + t) * rho / k2 ** mp.mpf(1.5)
  return dict(eps=eps, clt=clt, msd0=msd0, msd1=msd1, err=err, lower=clt - err,
              upper=clt + err)


def saddle_point(law, steps, eps):
  """t0 with steps K'(t0) = eps + 1/t0 + 1/(1 + t0) (eps(t) increases with t)."""
  eps = mp.mpf(eps)
  f = lambda u: (steps * tilted(law, mp.exp(u), 1, False)[1] - 1 / mp.exp(u)
                 - 1 / (1 + mp.exp(u)) - eps)
  return mp.exp(_root(f, -8, 6))


def delta(law, steps, eps):
  return saddle_terms(law, steps, saddle_point(law, steps, eps), eps)


def truth_delta(law, steps, eps):
  """The exact delta(eps) by the integral representation (eq. (37)) at the saddle point t0:
  e^{n K(t0) - eps t0} / pi * int_0^inf Re[chi(y)^n e^{-i eps y} / ((t0 + iy)(1 + t0 + iy))] dy,
  chi(y) = E_P[e^{(t0 + iy) L}] / E_P[e^{t0 L}] (one quadrature per y). chi^n decays like
  e^{-n K''(t0) y^2 / 2}: the integral stops at 16 standard deviations. (With atoms, |chi|^n
  revives near y = k pi / e0 to about (the atoms' tilted mass)^n: below 1e-9 relative for the
  Laplace laws here; nothing else is left out.) In 20 digits, which is plenty."""
  with mp.workdps(20):
    eps = mp.mpf(eps)
    t = saddle_point(law, steps, eps)
    k, _, k2 = tilted(law, t, 2, False)
    m0 = mp.exp(k)

    def integrand(y):
      z = mp.mpc(t, y)
      chi = law.expect(lambda l: 1, z) / m0
      return mp.re(chi ** steps * mp.exp(mp.mpc(0, -eps * y)) / (z * (1 + z)))
    top = 16 / mp.sqrt(steps * k2)
    integral = mp.quad(integrand, [top * i / 16 for i in range(17)])
    return +(mp.exp(steps * k - eps * t) / mp.pi * integral)


def truth_epsilon(law, steps, target):
  """eps with truth_delta(eps) = target: secant steps on log delta from SP-CLT's eps (log delta is
  smooth and nearly linear in eps), to 1e-13."""
  f = lambda e: mp.log(truth_delta(law, steps, e)) - mp.log(target)
  a = epsilon(law, steps, target)
  b = a + mp.mpf("0.01")
  fa, fb = f(a), f(b)
  while abs(b - a) > mp.mpf("1e-13"):
    a, b, fa = b, b - fb * (b - a) / (fb - fa), fb
    fb = f(b)
  return b


def epsilon(law, steps, target, quantity="clt"):
  """eps at which ``quantity`` (clt, msd0, msd1, lower, upper) of delta equals ``target``, along
  the saddle curve (None where it never does: a vacuous lower bound)."""
  log_target = mp.log(target)
  with_err = quantity in ("lower", "upper")

  def g(u):
    value = saddle_terms(law, steps, mp.exp(u), with_err=with_err)[quantity]
    return (mp.log(value) if value > 0 else -mp.inf) - log_target
  u = _root(g, -8, 6, decreasing=True)
  return None if u is None else saddle_terms(law, steps, mp.exp(u), with_err=False)["eps"]


def _root(f, lo, hi, decreasing=False, points=15):
  """A root of a monotone f on [lo, hi]: a scan for the sign change, then Anderson-Bjorck
  (after bisection while f is infinite at an end); None without a sign change."""
  grid = [lo + (hi - lo) * mp.mpf(i) / (points - 1) for i in range(points)]
  sign = -1 if decreasing else 1
  h = lambda u: sign * f(u)
  values = [h(u) for u in grid]
  for a, b, fa, fb in zip(grid, grid[1:], values, values[1:]):
    if fa <= 0 <= fb:
      while not (mp.isfinite(fa) and mp.isfinite(fb)):
        mid = (a + b) / 2
        fm = h(mid)
        a, b, fa, fb = (mid, b, fm, fb) if fm <= 0 else (a, mid, fa, fm)
      return mp.findroot(h, (a, b), solver="anderson", tol=mp.mpf("1e-40"))
  return None


def improved_rdp_epsilon(q, sigma, steps, target):
  """min over alpha of the improved conversion eq. (43): n R(alpha) + log(1 - 1/alpha)
  - (log delta + log alpha)/(alpha - 1), R the worse direction's per-step RDP K(alpha-1)/(alpha-1)
  (golden-section search in log alpha)."""
  def objective(u):
    a = 1 + mp.exp(u)
    rdp = max(tilted(SubsampledGaussian(q, sigma, add), a - 1, 0, False)[0]
              for add in (False, True)) / (a - 1)
    return steps * rdp + mp.log(1 - 1 / a) - (mp.log(target) + mp.log(a)) / (a - 1)
  lo, hi = mp.log(mp.mpf("0.01")), mp.log(mp.mpf(1000))
  ratio = (mp.sqrt(5) - 1) / 2
  c, d = hi - ratio * (hi - lo), lo + ratio * (hi - lo)
  fc, fd = objective(c), objective(d)
  while hi - lo > mp.mpf("1e-9"):
    if fc < fd:
      hi, d, fd = d, c, fc
      c = hi - ratio * (hi - lo)
      fc = objective(c)
    else:
      lo, c, fc = c, d, fd
      d = lo + ratio * (hi - lo)
      fd = objective(d)
  return min(fc, fd)


def _derivative(f, x, h):
  """Five-point central difference (error O(h^4))."""
  return (f(x - 2 * h) - 8 * f(x - h) + 8 * f(x + h) - f(x + 2 * h)) / (12 * h)


def main():
  show = lambda v, d=12: "nan" if v is None else mp.nstr(v, d)
  for q, sigma, t in (("0.01", 2, "0.5"), ("0.01", 2, "10.5"), ("0.01", 2, "27.3"),
                      ("0.1", 1, "0.5"), ("0.1", 1, "2.5"), (mp.mpf(256) / 60000, "1.1", "6.9")):
    print("K..K'''' q", show(q, 8), "sigma", sigma, "t", t,
          [show(v, 15) for v in tilted(SubsampledGaussian(q, sigma), t, 4, False)])
  for mu, eps in ((1, 1), ("0.5", 2), (1, 4), (5, 1)):
    out = delta(("gaussian", mu), 1, eps)
    print("Gaussian mu", mu, "eps", eps, {k: show(out[k], 10) for k in ("clt", "msd0", "msd1")})
  cases = [("subsampled Gaussian q 0.01 sigma 2 n 3000", lambda add: SubsampledGaussian(
      "0.01", 2, add), 3000, eps) for eps in ("0.5", 2, 3)]
  cases += [("Laplace b 10 n 500", lambda add: Laplace(10), 500, 4),
            ("Laplace b 2 n 100", lambda add: Laplace(2), 100, 25)]
  for name, law, steps, eps in cases:
    for add in (False, True):
      out = delta(law(add), steps, eps)
      print(name, "eps", eps, "add" if add else "remove",
            {k: show(out[k], 11) for k in ("clt", "err", "lower", "upper")})
  for q, sigma, steps, target in (("0.01", 2, 1983, "1e-15"), ("0.01", 2, 3048, "1e-15"),
                                  ("0.01", 2, 4500, "1e-15"), ("0.01", 1, 1000, "1e-5")):
    for add in (False, True):
      law = SubsampledGaussian(q, sigma, add)
      print("epsilon q", q, "sigma", sigma, "n", steps, "delta", target,
            "add" if add else "remove",
            [show(epsilon(law, steps, mp.mpf(target), k), 11) for k in ("lower", "clt", "upper")])
  eps_msd1 = lambda s: max(epsilon(SubsampledGaussian("0.01", s, add), 3000, mp.mpf("1e-5"),
                                   "msd1") for add in (False, True))
  print("d eps_msd1 / d sigma at q 0.01 sigma 2 n 3000 delta 1e-5:",
        show(_derivative(eps_msd1, mp.mpf(2), mp.mpf("1e-3")), 11))
  for sigma, q, steps in ((1, "0.01", 1000), (2, "0.01", 3000), ("1.1", mp.mpf(256) / 60000,
                                                                  14063)):
    print("improved RDP epsilon sigma", sigma, "q", show(q, 8), "n", steps, "delta 1e-5:",
          show(improved_rdp_epsilon(q, sigma, steps, mp.mpf("1e-5")), 10))


def truths():
  """The exact values of tests/test_spa.py (eq. (37)), each direction where it could matter."""
  sgd = lambda add: SubsampledGaussian("0.01", 2, add)
  for name, law, steps, eps in (("subsampled Gaussian q 0.01 sigma 2 n 3000 remove", sgd(False),
                                 3000, "0.5"),
                                ("subsampled Gaussian q 0.01 sigma 2 n 3000 add", sgd(True), 3000,
                                 "0.5"),
                                ("subsampled Gaussian q 0.01 sigma 2 n 3000 remove", sgd(False),
                                 3000, 2),
                                ("subsampled Gaussian q 0.01 sigma 2 n 3000 remove", sgd(False),
                                 3000, 3),
                                ("Laplace b 10 n 500", Laplace(10), 500, 4),
                                ("Laplace b 2 n 100", Laplace(2), 100, 25)):
    print("truth delta", name, "eps", eps, mp.nstr(truth_delta(law, steps, eps), 11), flush=True)
  # At eps = 2 and 3 the add direction's SP-CLT upper bound lies below the remove direction's
  # lower bound (main()), and here its upper epsilon below the remove direction's truth.
  law = SubsampledGaussian("0.01", 1)
  print("truth epsilon q 0.01 sigma 1 n 1000 delta 1e-5 remove",
        mp.nstr(truth_epsilon(law, 1000, mp.mpf("1e-5")), 11),
        "(add direction's SP-CLT upper:",
        mp.nstr(epsilon(SubsampledGaussian("0.01", 1, True), 1000, mp.mpf("1e-5"), "upper"), 8),
        ")")


if __name__ == "__main__":
  truths() if sys.argv[1:] == ["truths"] else main()
