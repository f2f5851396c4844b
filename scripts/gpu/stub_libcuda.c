/* A stub libcuda.so.1 for scripts/gpu/import_probe.py on a machine without a GPU: the symbols
   vLLM's and torch's extensions resolve at load time, each failing if called.
   gcc -shared -fPIC -o libcuda.so.1 stub_libcuda.c */
int cuCtxGetCurrent(void){return 1;}
int cuCtxSetCurrent(void){return 1;}
int cuDeviceGetAttribute(void){return 1;}
int cuDevicePrimaryCtxRetain(void){return 1;}
int cuGetErrorString(void){return 1;}
int cuGetProcAddress_v2(void){return 1;}
int cuMemAddressFree(void){return 1;}
int cuMemAddressReserve(void){return 1;}
int cuMemCreate(void){return 1;}
int cuMemGetAllocationGranularity(void){return 1;}
int cuMemMap(void){return 1;}
int cuMemRelease(void){return 1;}
int cuMemSetAccess(void){return 1;}
int cuMemUnmap(void){return 1;}
int cuPointerGetAttribute(void){return 1;}
int cuTensorMapEncodeTiled(void){return 1;}
