import os
import sys

# Test programs and helpers import from here and from src/ without installation.
sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "src"))
