// Empty stand-in: tests/simt/simt.h defines what CUDA code uses from cuda_bf16.h.
#pragma once
