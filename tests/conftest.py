import os
import sys

# Tests import the oracle module from this folder.
sys.path.insert(0, os.path.dirname(__file__))
