// Compiled by torch_wall.cmake with the flags of every file of a torch-free target: it must fail.
#include <ATen/ATen.h>
