// Stand-in for the part of Apple's Metal framework that custom_ops/metal/*.mm
// use (syntax checks on Linux only; see Foundation/Foundation.h). The
// macOS 15 additions (MTLMathMode...) are always declared: the host code
// guards them with __MAC_15_0, which the test defines or not.
#pragma once

#import <Foundation/Foundation.h>

typedef struct {
  NSUInteger width, height, depth;
} MTLSize;
static inline MTLSize MTLSizeMake(NSUInteger width, NSUInteger height, NSUInteger depth) {
  MTLSize s = {width, height, depth};
  return s;
}

typedef NS_ENUM(NSUInteger, MTLCommandBufferStatus){
    MTLCommandBufferStatusNotEnqueued = 0, MTLCommandBufferStatusEnqueued = 1, MTLCommandBufferStatusCommitted = 2,
    MTLCommandBufferStatusScheduled = 3,   MTLCommandBufferStatusCompleted = 4, MTLCommandBufferStatusError = 5,
};
// MTLResourceOptions: the storage mode in bits 4-7 (MTLResourceStorageModeShared = 0 << 4).
typedef NS_OPTIONS(NSUInteger, MTLResourceOptions){
    MTLResourceStorageModeShared = 0UL << 4, MTLResourceStorageModeManaged = 1UL << 4,
    MTLResourceStorageModePrivate = 2UL << 4};
// MTLBarrierScope (macOS 10.14): which resources a memory barrier orders.
typedef NS_OPTIONS(NSUInteger, MTLBarrierScope){
    MTLBarrierScopeBuffers = 1UL << 0, MTLBarrierScopeTextures = 1UL << 1, MTLBarrierScopeRenderTargets = 1UL << 2};
typedef NS_ENUM(NSInteger, MTLMathMode){MTLMathModeSafe = 0, MTLMathModeRelaxed = 1, MTLMathModeFast = 2};
typedef NS_ENUM(NSInteger, MTLMathFloatingPointFunctions){
    MTLMathFloatingPointFunctionsFast = 0, MTLMathFloatingPointFunctionsPrecise = 1};

@interface MTLCompileOptions : NSObject
@property(readwrite, nonatomic) BOOL fastMathEnabled __attribute__((deprecated("Use mathMode instead")));
@property(readwrite, nonatomic) MTLMathMode mathMode;
@property(readwrite, nonatomic) MTLMathFloatingPointFunctions mathFloatingPointFunctions;
@end

@protocol MTLDevice;

@protocol MTLResource <NSObject>
@property(readonly) id<MTLDevice> device;
@end

@protocol MTLBuffer <MTLResource>
@property(readonly) NSUInteger length;
- (void*)contents;
@end

@protocol MTLFunction <NSObject>
@property(readonly) id<MTLDevice> device;
@end

@protocol MTLLibrary <NSObject>
- (id<MTLFunction>)newFunctionWithName:(NSString*)functionName;
@end

@protocol MTLComputePipelineState <NSObject>
@property(readonly) id<MTLDevice> device;
@property(readonly) NSUInteger maxTotalThreadsPerThreadgroup;
@property(readonly) NSUInteger threadExecutionWidth;
@end

@protocol MTLDevice <NSObject>
@property(readonly) uint64_t registryID;
- (id<MTLLibrary>)newLibraryWithSource:(NSString*)source
                               options:(MTLCompileOptions*)options
                                 error:(NSError* __autoreleasing*)error;
- (id<MTLLibrary>)newLibraryWithURL:(NSURL*)url error:(NSError* __autoreleasing*)error;
- (id<MTLComputePipelineState>)newComputePipelineStateWithFunction:(id<MTLFunction>)computeFunction
                                                             error:(NSError* __autoreleasing*)error;
- (id<MTLBuffer>)newBufferWithBytes:(const void*)pointer length:(NSUInteger)length options:(MTLResourceOptions)options;
@end

@protocol MTLCommandEncoder <NSObject>
@property(readonly) id<MTLDevice> device;
- (void)endEncoding;
@end

@protocol MTLComputeCommandEncoder <MTLCommandEncoder>
- (void)setComputePipelineState:(id<MTLComputePipelineState>)state;
- (void)setBuffer:(id<MTLBuffer>)buffer offset:(NSUInteger)offset atIndex:(NSUInteger)index;
- (void)setBytes:(const void*)bytes length:(NSUInteger)length atIndex:(NSUInteger)index;
- (void)setThreadgroupMemoryLength:(NSUInteger)length atIndex:(NSUInteger)index;
- (void)dispatchThreads:(MTLSize)threadsPerGrid threadsPerThreadgroup:(MTLSize)threadsPerThreadgroup;
- (void)dispatchThreadgroups:(MTLSize)threadgroupsPerGrid threadsPerThreadgroup:(MTLSize)threadsPerThreadgroup;
- (void)memoryBarrierWithScope:(MTLBarrierScope)scope;
@end

@protocol MTLBlitCommandEncoder <MTLCommandEncoder>
- (void)copyFromBuffer:(id<MTLBuffer>)sourceBuffer
             sourceOffset:(NSUInteger)sourceOffset
                 toBuffer:(id<MTLBuffer>)destinationBuffer
        destinationOffset:(NSUInteger)destinationOffset
                     size:(NSUInteger)size;
@end

@protocol MTLEvent <NSObject>
@property(readonly) id<MTLDevice> device;
@end

@protocol MTLSharedEvent <MTLEvent>
@property(readwrite) uint64_t signaledValue;
- (BOOL)waitUntilSignaledValue:(uint64_t)value timeoutMS:(uint64_t)milliseconds;
@end

@protocol MTLCommandBuffer;
typedef void (^MTLCommandBufferHandler)(id<MTLCommandBuffer>);

@protocol MTLCommandBuffer <NSObject>
@property(readonly) id<MTLDevice> device;
@property(readonly) MTLCommandBufferStatus status;
@property(readonly) NSError* error;
@property(copy, atomic) NSString* label;
- (id<MTLComputeCommandEncoder>)computeCommandEncoder;
- (id<MTLBlitCommandEncoder>)blitCommandEncoder;
- (void)encodeWaitForEvent:(id<MTLEvent>)event value:(uint64_t)value;
- (void)encodeSignalEvent:(id<MTLEvent>)event value:(uint64_t)value;
- (void)addCompletedHandler:(MTLCommandBufferHandler)block;
- (void)commit;
- (void)waitUntilCompleted;
@end

@protocol MTLCommandQueue <NSObject>
@property(readonly) id<MTLDevice> device;
- (id<MTLCommandBuffer>)commandBuffer;
@end
