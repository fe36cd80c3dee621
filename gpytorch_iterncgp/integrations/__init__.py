r"""Other libraries' interfaces on top of the package (nothing imports them): scikit-learn estimators
(:mod:`.sklearn`) and a BoTorch model (:mod:`.botorch`)."""
