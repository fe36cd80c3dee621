"""GP-ALPS, by its public path: the model and its ELBO (:mod:`.models.alps`) and the exact Gibbs sampler
(:mod:`.models.alps_gibbs`)."""

from .models.alps import (
    GPALPS,
    GPALPSELBO,
    VARIATIONAL_FAMILIES,
    ELBOTerms,
    expected_log_likelihood,
    expected_log_likelihood_moments,
    noise_variances,
)
from .models.alps_gibbs import GibbsSamples, gibbs_sample, gibbs_sample_model

__all__ = [
    "VARIATIONAL_FAMILIES",
    "ELBOTerms",
    "GPALPS",
    "GPALPSELBO",
    "GibbsSamples",
    "expected_log_likelihood",
    "expected_log_likelihood_moments",
    "gibbs_sample",
    "gibbs_sample_model",
    "noise_variances",
]
