r"""Likelihoods and what the outer loops need of them.

:mod:`.adapters`: the likelihoods GPyTorch lacks and the adapters that give a loop :math:`\ell`, :math:`\nabla\ell`
and :math:`\mathbf W`; :mod:`.tilted`: EP's tilted moments of the one-latent likelihoods;
:mod:`.multinomial_probit`: the multinomial probit and its tilted moments by nested EP; :mod:`.negative_binomial`:
overdispersed counts, a learnt dispersion; :mod:`.quasi_poisson`: Poisson
likelihoods of non-negative real targets (rates, averages), the quasi-likelihood :math:`y \log\lambda - \lambda -
\log\Gamma(y + 1)`.
"""
