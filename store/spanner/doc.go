// Package spanner is a store on Cloud Spanner.
package spanner
