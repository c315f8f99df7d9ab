"""The exchanges that let each rank's decoder layers see the whole sequence for a share of the heads.

Nothing is re-exported here: import from the module that holds the exchange (`heads`, `ulysses`, `ring`, ...).
"""
