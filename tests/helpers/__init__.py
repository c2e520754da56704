"""Code the tests share (golden readers, replay calls, trainer configs,
named tolerances); no test lives here."""
