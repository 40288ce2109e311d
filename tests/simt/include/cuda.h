// Empty stand-in: tests/simt/simt.h defines what CUDA code uses from cuda.h.
#pragma once
