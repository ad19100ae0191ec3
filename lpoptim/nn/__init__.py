"""Low-bit linear layers (FP8, FP4, INT4 GEMMs forward and backward), convert_linears, and FP8 all-gathers of their
weights under FSDP2."""
from .convert import convert_linears, converted
from .fp8_all_gather import fp8_all_gather
from .functional import Fp4LinearFunction, Fp8LinearFunction, Int4LinearFunction, lowbit_linear
from .linear_cross_entropy import linear_cross_entropy
from .linear import Fp4Linear, Fp8Linear, Int4Linear, LowBitLinear
from .recipes import RECIPES, Recipe, get_recipe

__all__ = ["fp8_all_gather", "linear_cross_entropy", "convert_linears", "converted", "lowbit_linear", "LowBitLinear", "Fp8Linear", "Fp4Linear", "Int4Linear",
           "Fp8LinearFunction", "Fp4LinearFunction", "Int4LinearFunction", "Recipe", "RECIPES", "get_recipe"]
